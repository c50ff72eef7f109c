"""Fixtures for the anchor tests: a tiny verifiable task (tokenizer and tiny model: tests/conftest.py)."""

from __future__ import annotations

import pytest
from anchor_fakes import EchoTask


@pytest.fixture
def task():
    return EchoTask()
