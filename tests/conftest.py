"""Fixtures shared by the test packages: the built-in tokenizer, a random-init tiny model, the
parity task as the trainer's task, tiny-run overrides and one torch thread."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY, ParityTask

from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``: one worker per core) each worker and every process it
    starts (CLI runs, Ray workers, learner ranks, servers) runs one torch thread, so the
    workers do not oversubscribe the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_model("tiny", tokenizer, seed=0).eval()


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
    return list(TINY)


@pytest.fixture
def one_thread():
    """One torch thread in this process: what spawned ranks, workers and servers compared
    with it use (float results depend on the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
