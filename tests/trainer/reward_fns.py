"""Reward functions a test run names as ``reward_fns:NAME`` (TRL's signature)."""

from __future__ import annotations

CALLS: list[dict] = []


def quarter(prompts, completions, **columns):
    """0.25 for every completion; records the columns it was given."""
    CALLS.append({k: list(v) for k, v in columns.items()})
    return [0.25] * len(completions)


def answer_length(prompts, completions, answer, **_):
    """The gold answer's length, or None (no verdict) when it is longer than 3."""
    return [float(len(a)) if len(a) <= 3 else None for a in answer]


def broken(prompts, completions, **_):
    raise RuntimeError("verifier crashed")
