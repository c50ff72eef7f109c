"""Fixtures shared by the test packages: the built-in tokenizer and a random-init tiny model."""

from __future__ import annotations

import pytest

from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_model("tiny", tokenizer, seed=0).eval()
