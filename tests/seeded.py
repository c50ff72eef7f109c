"""Seeded engine requests for tests (importable from every test package: tests/ is on the
path because of tests/conftest.py)."""

from __future__ import annotations

from anchor_rl.rollout.engine import Request, group_requests


def requests(prompts: list[str], n: int = 1, seed: int = 0) -> list[Request]:
    """``n`` seeded requests per prompt (group i for prompts[i])."""
    return group_requests(prompts, list(range(len(prompts))), n, "test", seed)
