"""Fixtures for the serving tests: a random-init tiny model saved to disk, and `anchor-rl serve`'s
app on a free loopback port in a thread of this process (so both sides of a comparison sample
with the same torch thread count)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import load_policy, save_policy
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.serve.app import ServerThread, build_app
from anchor_rl.serve.model import ModelServer

THREADS = 1


@pytest.fixture(scope="module")
def one_thread():
    """The server thread and the in-process engine share the process's torch thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """``build_model("tiny", build_tokenizer(), seed=0)`` saved as a model directory."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    save_policy(build_model("tiny", tokenizer, seed=0), tokenizer, path)
    return path


@pytest.fixture(scope="module")
def served(tiny_dir, one_thread):
    """``anchor-rl serve --model <tiny_dir>`` on a free port: yields (ServerThread, ModelServer)."""
    model, tokenizer = load_policy(tiny_dir)
    server = ModelServer(model, tokenizer, "tiny")
    with ServerThread(build_app(server, batch_wait_ms=5.0)) as thread:
        yield thread, server


@pytest.fixture
def url(served) -> str:
    """The server's base URL, ``http://127.0.0.1:PORT`` (the API is under /v1)."""
    return served[0].url
