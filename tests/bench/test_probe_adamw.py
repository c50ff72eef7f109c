"""benchmarks/probe_adamw.py: the default and the fused AdamW step timed in turn over a model's
parameters, and how far apart their weights end up."""

from __future__ import annotations

import probe_adamw as probe
import torch

from anchor_rl.trainer.update import adamw


def test_both_ways_are_timed_and_end_within_rounding() -> None:
    result = probe.step_times("random:tiny", repeats=2)
    assert result["parameters"] > 10**6  # tiny: about 1.1M
    assert set(result["step_ms"]) == {"foreach", "fused"}
    assert all(ms > 0 for ms in result["step_ms"].values())
    # ten steps at lr 1e-4 move a weight by up to ~1e-3: the two ways agree far below that
    assert 0 <= result["max_abs_difference_after_10_steps"] < 1e-6


def test_the_trainers_adamw_is_fused_only_on_plain_cpu_or_cuda_tensors() -> None:
    linear = torch.nn.Linear(4, 4)
    assert adamw(linear.parameters(), lr=1e-3).defaults["fused"] is True
    assert adamw(linear.to(torch.bfloat16).parameters(), lr=1e-3).defaults["fused"] is True

    class Subclass(torch.Tensor):
        """Stands in for a DTensor (FSDP's sharded parameters): not a plain tensor."""

    weight = torch.nn.Parameter(torch.zeros(3).as_subclass(Subclass))
    assert adamw([weight], lr=1e-3).defaults["fused"] is None  # PyTorch's default
