"""The collective weight sync's pieces without Ray (``anchor_rl.cluster.broadcast``): the bucket
plan and its flatten/unflatten round trip across dtypes, a two-rank gloo group sending a state,
and the refusals (a bad value, NCCL ranks sharing a GPU)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.cluster.broadcast import (
    DriverGroup,
    SyncGroup,
    WeightSyncError,
    check_collective,
    driver_gpus,
    flatten,
    gpus_shared,
    plan_buckets,
    sync_placement,
    unflatten,
)
from anchor_rl.cluster.data_parallel import Placement
from anchor_rl.errors import ConfigError
from anchor_rl.trainer.config import load_config

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


states = st.lists(
    st.tuples(
        st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers()
    ),
    min_size=1,
    max_size=8,
).map(
    lambda specs: {
        f"t{i}": _tensor(dtype, tuple(shape), seed % 2**31)
        for i, (dtype, shape, seed) in enumerate(specs)
    }
)


@settings(max_examples=60, deadline=None)
@given(state=states, bucket_bytes=st.integers(1, 200))
def test_buckets_round_trip_every_tensor_across_dtypes(state, bucket_bytes) -> None:
    buckets = plan_buckets(state, bucket_bytes)
    names = [e.name for b in buckets for e in b.entries]
    assert sorted(names) == sorted(state)  # each tensor in exactly one bucket
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        assert all(state[e.name].dtype == bucket.dtype for e in bucket.entries)
        assert bucket.nbytes <= bucket_bytes or len(bucket.entries) == 1
        flat = flatten(bucket, state, "cpu")
        assert flat.shape == (bucket.numel,) and flat.dtype == bucket.dtype
        out.update(unflatten(flat, bucket))
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name


def test_buckets_keep_each_dtype_in_state_order_and_fill_up_to_the_bound() -> None:
    state = {
        "a": torch.zeros(4),  # 16 bytes
        "h": torch.zeros(4, dtype=torch.bfloat16),  # 8 bytes
        "b": torch.zeros(2),  # 8 bytes
        "c": torch.zeros(10),  # 40 bytes: alone
        "d": torch.zeros(1),
    }
    plan = [(b.dtype, [e.name for e in b.entries]) for b in plan_buckets(state, 24)]
    assert plan == [
        (torch.float32, ["a", "b"]),
        (torch.float32, ["c"]),
        (torch.float32, ["d"]),
        (torch.bfloat16, ["h"]),
    ]


def test_flatten_refuses_a_tensor_that_is_not_the_planned_one() -> None:
    (bucket,) = plan_buckets({"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="w: torch.float32 \\(3, 2\\) is not the planned"):
        flatten(bucket, {"w": torch.zeros(3, 2)}, "cpu")


def _pair(state, buckets, sent_version: int, expected_version: int, timeout: float = 20):
    """Rank 0 sends ``state`` to rank 1 (a thread) over gloo; rank 1's state or error."""
    store = SyncGroup.open_store("127.0.0.1", 2, timeout)
    out: dict = {}

    def rank1() -> None:
        group = SyncGroup.join("127.0.0.1", store.port, 1, 2, "cpu", timeout)
        try:
            out["state"] = group.receive(buckets, expected_version)
        except RuntimeError as exc:
            out["error"] = exc

    thread = threading.Thread(target=rank1)
    thread.start()
    group = SyncGroup(store, 0, 2, sync_placement("cpu"), timeout)
    try:
        group.send(buckets, state, sent_version)
    except RuntimeError as exc:  # rank 1 left after the header: the timeout ends the send
        out["send_error"] = exc
    thread.join(30)
    return out


def test_a_gloo_group_sends_a_state_of_several_dtypes_exactly() -> None:
    state = {
        "w": torch.randn(5, 3),
        "h": torch.randn(7).bfloat16(),
        "n": torch.arange(4),
        "m": torch.tensor([True, False, True]),
        "v": torch.randn(2),
    }
    buckets = plan_buckets(state, 32)
    got = _pair(state, buckets, 3, 3)["state"]
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_receiver_at_another_version_raises() -> None:
    state = {"w": torch.randn(3)}
    out = _pair(state, plan_buckets(state), 4, 3, timeout=2)
    assert "state" not in out and "send_error" in out
    assert "driver sent version 4" in str(out["error"]), out


def test_the_backend_and_device_come_from_placement() -> None:
    assert sync_placement("cpu") == Placement("gloo", torch.device("cpu"))
    assert sync_placement(torch.device("cuda", 1)) == Placement("nccl", torch.device("cuda", 1))


@pytest.mark.parametrize(
    ("gpus", "message"), [(0, "these workers have none"), (0.5, "two NCCL ranks on one GPU")]
)
def test_collective_on_cuda_needs_whole_gpus_per_worker(gpus, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_collective(torch.device("cuda"), gpus)
    check_collective(torch.device("cuda"), 1)  # whole GPUs: fine
    check_collective(torch.device("cpu"), 0.5)  # a CPU learner: gloo, CPU tensors


def test_workers_given_the_learners_gpu_are_refused(monkeypatch) -> None:
    """NCCL refuses two ranks on one GPU: the group is not built when Ray gave a worker the
    GPU the learner uses on its node."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert driver_gpus(torch.device("cuda", 1)) == {"5"}
    assert gpus_shared(("n1", {"5"}), [("n1", {"3"}), ("n2", {"5"}), ("n1", {"5", "6"})]) == [2]

    class Actor:
        def __init__(self, node: str, gpus: set[str]) -> None:
            self.where = SimpleNamespace(remote=lambda: (node, gpus))

    ray = SimpleNamespace(
        get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "n1"),
        get=lambda refs, timeout=None: list(refs),
    )
    group = DriverGroup(ray, torch.device("cuda", 0), timeout=5)  # the learner on GPU "3"
    actors = [Actor("n1", {"5"}), Actor("n1", {"3"})]
    with pytest.raises(ValueError, match=r"rollout workers \[1\] were given the learner's GPU"):
        group.sync(actors, {}, [], 1)


def test_the_config_refuses_a_bad_weight_sync_and_one_without_workers() -> None:
    with pytest.raises(ConfigError, match="weight_sync"):
        load_config("grpo", ["cluster.rollout_workers=2", "cluster.weight_sync=nccl"])
    with pytest.raises(ConfigError, match="cluster.weight_sync has no effect"):
        load_config("grpo", ["cluster.weight_sync=collective"])
    name, options = load_config(
        "grpo", ["cluster.rollout_workers=2", "cluster.weight_sync=collective"]
    ).engine
    assert (name, options["weight_sync"]) == ("ray", "collective")
    assert "weight_sync" not in load_config("grpo", ["cluster.rollout_workers=2"]).engine[1]


def test_a_failed_broadcast_raises_naming_the_failure_and_the_workers(monkeypatch) -> None:
    """The driver's side of a broadcast a worker died in: WeightSyncError with the error and
    each worker's, and the group dropped (rebuilt by the next sync)."""

    class Died(Exception):
        pass

    class Actor:
        receive = SimpleNamespace(remote=lambda: "ref")

    def get(refs, timeout=None):
        raise Died("actor gone")

    def send(self, *args):
        raise RuntimeError("Connection closed by peer\ntraceback...")

    monkeypatch.setattr(SyncGroup, "send", send)
    group = DriverGroup(SimpleNamespace(get=get), torch.device("cpu"), timeout=5)
    inner = SyncGroup.__new__(SyncGroup)  # a group whose send fails
    inner._group = None
    group._group, group._actors = inner, [actor := Actor()]
    with pytest.raises(WeightSyncError) as error:
        group.sync([actor], {}, [], 7)
    assert str(error.value) == (
        "the collective weight sync (version 7, gloo) failed: RuntimeError: Connection closed "
        "by peer (worker 0: Died)"
    )
    assert group._group is None
