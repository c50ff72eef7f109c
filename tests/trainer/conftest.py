"""A toy task a random-init model earns reward on, so tiny runs have non-zero gradients."""

from __future__ import annotations

import pytest

from anchor_rl.tasks.base import Record, Task

_TINY = [
    "model=random:tiny",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "eval.prompts=3",
    "eval.every=2",
    "log.progress=false",
]


class ParityTask(Task):
    """Reward 1 when the completion's first character has an even code point.

    A random-init model gets it right about half the time, so groups of a few responses
    are mixed and all-equal about equally often (what dynamic sampling filters).
    """

    name = "parity"

    def records(self, split):
        offset = 0 if split == "train" else 100
        return [Record(f"{split}-{i}", f"q{i + offset}", "even") for i in range(8)]

    def reward(self, completion, record):
        return float(bool(completion) and ord(completion[0]) % 2 == 0)

    def trace(self, record):
        return "0"


@pytest.fixture
def parity(monkeypatch, tmp_path_factory) -> ParityTask:
    """Make the trainer's ``get_task`` return the parity task whatever the name (and keep
    runs' caches, such as value pretraining's, out of the user's cache)."""
    task = ParityTask()
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setattr("anchor_rl.trainer.run.get_task", lambda name, **kwargs: task)
    return task


@pytest.fixture
def tiny() -> list[str]:
    """Overrides that make any preset a run of a second or two on a random-init model."""
    return list(_TINY)
