"""glibc's allocator settings for training processes (``anchor_rl.allocator``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from anchor_rl import allocator

FAULTS = """
import json, resource, torch
from anchor_rl.allocator import keep_freed_memory
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer
kept = keep_freed_memory()
model = build_model("tiny", build_tokenizer(), seed=0)
ids = torch.randint(0, 100, (32, 64), generator=torch.Generator().manual_seed(0))
def step():  # a training step's allocations: a forward and a backward pass
    model(input_ids=ids).logits.log_softmax(-1).mean().backward()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm up: the heap reaches its peak
    step()
before = faults()
for _ in range(10):
    step()
print(json.dumps({"kept": kept, "faults": faults() - before}))
"""


def _faults(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_tensors_are_reused_without_page_faults():
    """By default glibc gives much of what a forward and backward pass freed back to the
    kernel, and the next pass faults it in again (~5,000 pages a pass of ``tiny`` on 32 x
    64 tokens, measured); kept, the next pass reuses it."""
    default = _faults({allocator.OFF: "default"})
    kept = _faults({})
    assert not default["kept"] and kept["kept"]
    assert default["faults"] > 10 * 1000
    assert kept["faults"] < default["faults"] / 5


def test_user_settings_and_the_opt_out_leave_glibc_alone(monkeypatch):
    monkeypatch.setenv(allocator.OFF, "default")
    assert not allocator._apply()
    monkeypatch.delenv(allocator.OFF)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not allocator._apply()
