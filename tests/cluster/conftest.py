"""Fixtures of the cluster tests: a local Ray per module (the parity task, tiny-run overrides and
one torch thread come from tests/conftest.py)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """Ray started in this process with 2 CPUs for the module, shut down after it."""
    import ray

    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # no token auth for a local test cluster
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # never a running cluster
    yield ray
    ray.shutdown()
    if before is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = before
