"""Where data-parallel learner ranks run (``data_parallel.placement``): gloo on the CPU, NCCL
with one GPU per rank on CUDA, decided by that one function for rank 0 and the spawned ranks
alike; the collectives' own tensors go to the rank's device."""

from __future__ import annotations

import ast
import inspect
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from anchor_rl.cluster import data_parallel, learners
from anchor_rl.cluster.data_parallel import DataParallel, Placement, placement


def test_the_cpu_is_gloo_for_every_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")  # a launcher's: the CPU ignores it
    for rank in range(3):
        assert placement("cpu", rank, 3) == Placement("gloo", torch.device("cpu"))


def test_cuda_is_nccl_with_one_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for device in ("cuda", "cuda:0"):
        assert [placement(device, r, 4) for r in range(4)] == [
            Placement("nccl", torch.device("cuda", r)) for r in range(4)
        ]
    assert placement("cuda", 3, 4, local_rank=1).device == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")  # a launcher's (torchrun) local rank
    assert placement("cuda", 0, 4).device == torch.device("cuda", 2)
    with pytest.raises(ValueError, match="needs one GPU per rank; this process sees 4"):
        placement("cuda", 0, 8)


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="rank r on cuda:r"):
        placement("cuda:1", 0, 2)
    with pytest.raises(ValueError, match="run on cpu or cuda, not 'mps'"):
        placement("mps", 0, 2)


def backend_names(source: str) -> int:
    """How many string constants of ``source`` name a process-group backend."""
    tree = ast.parse(textwrap.dedent(source))
    return sum(isinstance(n, ast.Constant) and n.value in ("gloo", "nccl") for n in ast.walk(tree))


def test_the_backend_is_named_in_placement_only():
    """The learners' start (rank 0 and the spawned ranks) names no backend: it comes from
    ``placement``, as the device does, so the NCCL path differs from the tested gloo one there
    only."""
    assert backend_names(inspect.getsource(learners)) == 0
    assert inspect.getsource(learners).count("placement(cfg.device") == 2  # rank 0, a rank
    assert backend_names(inspect.getsource(data_parallel)) == 2
    assert backend_names(inspect.getsource(placement)) == 2


def test_the_stop_vote_runs_on_the_ranks_device(tmp_path):
    """``stopping``'s all-reduce takes a tensor on ``DataParallel.device`` (a one-rank gloo
    group here; NCCL needs it on the rank's GPU)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    try:
        seen = []
        original = dist.all_reduce
        dist.all_reduce = lambda t, *a, **k: (seen.append(t.device), original(t, *a, **k))[1]
        try:
            dp = DataParallel(0, 1, device=torch.device("cpu"))
            assert dp.stopping(True) == [0] and dp.stopping(False) == []
        finally:
            dist.all_reduce = original
        assert seen == [torch.device("cpu")] * 2 and dp.device == torch.device("cpu")
    finally:
        dist.destroy_process_group()
