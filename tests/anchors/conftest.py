"""Shared fixtures for the anchor tests: a tiny verifiable task, the built-in tokenizer, a tiny model."""

from __future__ import annotations

import pytest
from anchor_fakes import EchoTask

from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_model("tiny", tokenizer, seed=0).eval()


@pytest.fixture
def task():
    return EchoTask()
