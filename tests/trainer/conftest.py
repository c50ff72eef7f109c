"""The parity task (tests/toy_tasks.py) as the trainer's task, and tiny-run overrides."""

from __future__ import annotations

import pytest
from toy_tasks import ParityTask

_TINY = [
    "model=random:tiny",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "eval.prompts=3",
    "eval.every=2",
    "log.progress=false",
]


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
