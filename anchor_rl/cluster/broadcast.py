"""Collective weight sync: the driver broadcasts the sampling state to its Ray rollout workers.

``RayEngine(weight_sync="collective")`` joins the driver (rank 0) and its N rollout workers
(ranks 1..N) in one torch.distributed process group of their own, world N + 1: a TCP
rendezvous on a free port of the driver's node, a ``ProcessGroup`` object built directly
(never torch's default group, which the driver may hold as learner rank 0). Backend and
device come from :func:`~anchor_rl.cluster.data_parallel.placement`, as the learners' do:
gloo and CPU tensors when the learner runs on the CPU, NCCL and each rank's GPU when it runs
on CUDA. Nothing else differs between the two.

A sync sends the same tensors as the object-store path (``models.lora.sampling_state``: the
``state_dict``, or a LoRA policy's merged weights) in buckets: the tensors grouped by dtype
in ``state_dict`` order, each group cut into buckets of at most ``bucket_bytes`` (a larger
tensor is a bucket of its own), each bucket flattened into one 1-D tensor and broadcast as
bytes. The bucket plan travels with the Ray call that prepares the workers; a header
broadcast first (``[version, buckets, bytes]``) checks that the workers and the driver are
at the same sync.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from anchor_rl.cluster.data_parallel import Placement, placement

WeightSync = Literal["object_store", "collective"]
WEIGHT_SYNCS: tuple[str, ...] = ("object_store", "collective")

BUCKET_BYTES = 256 << 20
"""The most bytes one broadcast carries (a tensor larger than that goes alone)."""

SYNC_TIMEOUT_S = 300.0
"""Default bound of the rendezvous and of each collective: a rank that never comes (dead,
stuck) fails the sync after it instead of hanging the driver."""


class Entry(NamedTuple):
    """One tensor of a bucket: its ``state_dict`` name and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Bucket(NamedTuple):
    """Tensors of one dtype flattened into one 1-D tensor for one broadcast, in order."""

    dtype: torch.dtype
    entries: tuple[Entry, ...]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(
    state: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
) -> list[Bucket]:
    """The buckets of ``state``: its tensors grouped by dtype (the dtypes in order of first
    appearance, the tensors in ``state`` order), each group cut greedily into buckets of at
    most ``bucket_bytes``; a tensor larger than ``bucket_bytes`` is a bucket alone. Reads the
    tensors' dtype and shape only."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[Entry]] = {}
    for name, tensor in state.items():
        by_dtype.setdefault(tensor.dtype, []).append(Entry(name, tuple(tensor.shape)))
    buckets: list[Bucket] = []
    for dtype, entries in by_dtype.items():
        size = dtype.itemsize
        current: list[Entry] = []
        used = 0
        for entry in entries:
            nbytes = entry.numel * size
            if current and used + nbytes > bucket_bytes:
                buckets.append(Bucket(dtype, tuple(current)))
                current, used = [], 0
            current.append(entry)
            used += nbytes
        if current:
            buckets.append(Bucket(dtype, tuple(current)))
    return buckets


def flatten(
    bucket: Bucket, state: Mapping[str, torch.Tensor], device: torch.device | str
) -> torch.Tensor:
    """The bucket's tensors of ``state`` concatenated into one 1-D tensor ``[bucket.numel]``
    of its dtype on ``device`` (a copy). ValueError if a tensor's dtype or shape differs from
    the plan's."""
    parts = []
    for entry in bucket.entries:
        tensor = state[entry.name]
        if tensor.dtype != bucket.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"{entry.name}: {tensor.dtype} {tuple(tensor.shape)} is not the planned "
                f"{bucket.dtype} {entry.shape}"
            )
        parts.append(tensor.detach().reshape(-1).to(device))
    if not parts:
        return torch.empty(0, dtype=bucket.dtype, device=device)
    return torch.cat(parts)


def unflatten(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """The bucket's tensors, by name, as views of ``flat`` (``[bucket.numel]``, its dtype)
    with their shapes: the inverse of :func:`flatten`."""
    if flat.dtype != bucket.dtype or flat.shape != (bucket.numel,):
        raise ValueError(
            f"a {bucket.dtype} bucket of {bucket.numel} elements got {flat.dtype} {tuple(flat.shape)}"
        )
    pieces = flat.split([e.numel for e in bucket.entries])
    return {e.name: p.view(e.shape) for e, p in zip(bucket.entries, pieces, strict=True)}


def sync_placement(device: torch.device | str) -> Placement:
    """The backend and the tensors' device of one rank of the weight-sync group whose learner
    runs on ``device`` (a worker passes the learner's device type; Ray shows a GPU worker its
    own GPU as ``cuda:0``): :func:`~anchor_rl.cluster.data_parallel.placement`'s, a group of
    its own with this rank's GPU."""
    kind = torch.device(device)
    return placement(kind.type, 0, 1, local_rank=kind.index or 0)


class SyncGroup:
    """This process's rank in a weight-sync group: rank 0, the driver, hosts the TCP
    rendezvous (:meth:`open_store`, then this constructor); the workers :meth:`join` it.
    ``timeout`` (seconds) bounds the rendezvous and each broadcast."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        where: Placement,
        timeout: float,
    ) -> None:
        self.rank, self.world, self.where = rank, world, where
        self.timeout = datetime.timedelta(seconds=timeout)
        self._store = store  # kept alive with the group
        backends = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL"}  # see placement
        group_class = getattr(dist, backends[where.backend], None)
        if group_class is None:
            raise RuntimeError(f"this torch build has no {where.backend} process group")
        with _on(where.device):
            self._group = group_class(store, rank, world, self.timeout)

    @staticmethod
    def open_store(host: str, world: int, timeout: float) -> Any:
        """The rendezvous store rank 0 hosts, on a free port of ``host`` (``.port``)."""
        return dist.TCPStore(
            host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )  # fmt: skip

    @classmethod
    def join(
        cls, host: str, port: int, rank: int, world: int, device: str, timeout: float
    ) -> SyncGroup:
        """Rank ``rank`` (>= 1) joining rank 0's store at ``host:port``; ``device``: the
        learner's device type (``cpu`` or ``cuda``), which decides the backend."""
        store = dist.TCPStore(
            host, port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        return cls(store, rank, world, sync_placement(device), timeout)

    def send(
        self, buckets: Sequence[Bucket], state: Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Rank 0: broadcast the header, then each bucket of ``state``, one bucket in memory
        at a time."""
        self._broadcast(self._header(buckets, version))
        for bucket in buckets:
            self._broadcast(flatten(bucket, state, self.where.device))

    def receive(self, buckets: Sequence[Bucket], version: int) -> dict[str, torch.Tensor]:
        """Ranks >= 1: the state rank 0 sends (tensors on this rank's device); RuntimeError
        if rank 0's header is not the one this sync expects (another version or plan)."""
        expected = self._header(buckets, version)
        header = torch.zeros_like(expected)
        self._broadcast(header)
        if not torch.equal(header, expected):
            sent, mine = header.tolist(), expected.tolist()
            raise RuntimeError(
                f"weight sync out of step: the driver sent version {sent[0]} ({sent[1]} "
                f"buckets, {sent[2]} bytes) and this worker expected version {mine[0]} "
                f"({mine[1]} buckets, {mine[2]} bytes)"
            )
        state: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.where.device)
            self._broadcast(flat)
            state.update(unflatten(flat, bucket))
        return state

    def abort(self) -> None:
        """End this rank's connections, so the other ranks' pending collectives fail now
        instead of at their timeout."""
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):  # gloo: its connections close as it is freed
                group.abort()

    def _header(self, buckets: Sequence[Bucket], version: int) -> torch.Tensor:
        total = sum(b.nbytes for b in buckets)
        return torch.tensor([version, len(buckets), total], dtype=torch.int64,
                            device=self.where.device)  # fmt: skip

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self._group is None:
            raise RuntimeError("this weight-sync group was aborted")
        raw = tensor.view(torch.uint8) if tensor.numel() else tensor
        if raw.numel():
            with _on(self.where.device):
                self._group.broadcast(raw, 0, self.timeout).wait(self.timeout)


def gpus_shared(driver: tuple[str, set[str]], workers: Iterable[tuple[str, set[str]]]) -> list[int]:
    """The workers (by index) given a GPU the driver uses on the driver's node: each is
    ``(node id, GPU ids)``. NCCL refuses two ranks of one group on one GPU."""
    node, gpus = driver
    return [w for w, (n, g) in enumerate(workers) if n == node and g & gpus]


def driver_gpus(device: torch.device) -> set[str]:
    """The GPU ids (as Ray counts them on this node: ``CUDA_VISIBLE_DEVICES`` entries, else
    indices) a learner on ``device`` uses; none on the CPU."""
    if device.type != "cuda":
        return set()
    index = device.index or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        ids = [v.strip() for v in visible.split(",")]
        return {ids[index]} if index < len(ids) else set()
    return {str(index)}


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """The CUDA device ``device`` current inside (nothing to do on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class WeightSyncError(RuntimeError):
    """A collective sync that failed: a rank died, timed out or was out of step."""


class DriverGroup:
    """The driver's side of collective syncs: rank 0 of a group over the engine's actors,
    built on the first sync and rebuilt when the actors change (a restarted worker) or a
    sync failed. ``device``: where the learner's weights live (it picks the backend)."""

    def __init__(self, ray: Any, device: torch.device, timeout: float) -> None:
        self._ray, self.timeout = ray, timeout
        self.where = sync_placement(device)
        self._device = device
        self._group: SyncGroup | None = None
        self._actors: list[Any] = []

    def sync(
        self,
        actors: Sequence[Any],
        state: Mapping[str, torch.Tensor],
        buckets: Sequence[Bucket],
        version: int,
    ) -> None:
        """Broadcast ``state`` to ``actors`` (each prepared with ``buckets`` and ``version``):
        their ``receive`` calls are sent first, so they wait in the broadcast while this
        process sends; WeightSyncError (the group dropped) if any rank fails or the
        broadcast outlasts the timeout."""
        ray, refs = self._ray, []
        try:
            if self._group is None or list(self._actors) != list(actors):
                self._build(actors)
            assert self._group is not None
            refs = [a.receive.remote() for a in actors]
            self._group.send(buckets, state, version)
            ray.get(refs, timeout=self.timeout)
        except (WeightSyncError, ValueError):  # a refusal, not a failure
            raise
        except Exception as exc:
            self.close()  # the workers' receive fails too, once the driver's side is gone
            failed = []
            for w, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=self.timeout)
                except Exception as error:
                    failed.append(f"worker {w}: {type(error).__name__}")
            raise WeightSyncError(
                f"the collective weight sync (version {version}, {self.where.backend}) failed: "
                f"{type(exc).__name__}: {_first_line(exc)}"
                + (f" ({', '.join(failed)})" if failed else "")
            ) from exc

    def close(self) -> None:
        """Leave the group (the workers leave theirs when they join the next one, or die)."""
        if self._group is not None:
            self._group.abort()
        self._group, self._actors = None, []

    def _build(self, actors: Sequence[Any]) -> None:
        ray, world = self._ray, len(actors) + 1
        self.close()
        if self.where.device.type == "cuda":
            node = ray.get_runtime_context().get_node_id()
            places = ray.get([a.where.remote() for a in actors], timeout=self.timeout)
            if shared := gpus_shared((node, driver_gpus(self.where.device)), places):
                raise ValueError(
                    f"rollout workers {shared} were given the learner's GPU "
                    f"({self.where.device}); NCCL refuses two ranks of one group on one GPU. "
                    "Keep the learner's GPU out of Ray (start Ray with the other GPUs "
                    "visible) or set cluster.weight_sync=object_store"
                )
        host = ray.util.get_node_ip_address()
        store = SyncGroup.open_store(host, world, self.timeout)
        device = self.where.device.type
        refs = [
            a.join_group.remote(host, store.port, rank, world, device, self.timeout)
            for rank, a in enumerate(actors, start=1)
        ]
        group = SyncGroup(store, 0, world, self.where, self.timeout)
        ray.get(refs, timeout=self.timeout)
        self._group, self._actors = group, list(actors)


def check_collective(device: torch.device, gpus_per_worker: float) -> None:
    """ValueError for collective syncs that cannot run: a learner on CUDA (NCCL) with
    workers on the CPU or sharing GPUs (a fraction: NCCL needs one GPU per rank)."""
    if sync_placement(device).device.type != "cuda":
        return
    if gpus_per_worker == 0:
        raise ValueError(
            "weight_sync=collective with the learner on CUDA broadcasts over NCCL to the "
            "workers' GPUs, and these workers have none: set "
            "rollout.engine_args.num_gpus_per_worker=1 or cluster.weight_sync=object_store"
        )
    if gpus_per_worker != int(gpus_per_worker):
        raise ValueError(
            f"weight_sync=collective with num_gpus_per_worker={gpus_per_worker:g}: workers "
            "sharing a GPU would be two NCCL ranks on one GPU, which NCCL refuses; give each "
            "worker whole GPUs or set cluster.weight_sync=object_store"
        )
