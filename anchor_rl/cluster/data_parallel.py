"""Data parallelism over torch.distributed ranks: what each rank does inside one update.

Every rank holds the whole step's batch and the same mini-batch schedule. For each
mini-batch a rank backpropagates its share of the rows (rows ``rank, rank + world, ...``)
with the *mini-batch's* loss normalisers (its token and sequence counts, which every rank
computes from the whole mini-batch), so the per-rank gradients sum to the gradient of the
whole mini-batch's loss: a token-mean over 2 ranks is the token-mean over the batch, not the
mean of two means. The step's metrics are summed the same way (:meth:`DataParallel.sum_stats`).

Replicated ranks (the default) train their module through torch's
``DistributedDataParallel`` (:meth:`DataParallel.wrap`, with a communication hook that sums
the gradients instead of averaging them): its hooks all-reduce the gradients in buckets
while the backward pass is still running. A rank's micro-batches accumulate under
``no_sync`` and the last one synchronises (:meth:`DataParallel.passes`), so each rank
takes part in one all-reduce per mini-batch whatever its number of micro-batches; a rank
with no rows in a mini-batch runs one zero-weighted pass to take part in it. Every rank
then takes the same optimiser step, so the replicas stay equal (tested), and rank 0's
weights are the run's.

With ``cluster.learner_sharding = "fsdp"`` the ranks hold FSDP2 shards instead of replicas
(:func:`shard_model`): FSDP reduce-scatters the gradients itself, summed as above (its
divide factor set to 1), and every forward all-gathers a layer's parameters from every
rank, so the ranks run their forward and backward passes in lockstep: a rank whose share
of a mini-batch has fewer micro-batches than another's runs a zero-weighted pass for each
missing one (:meth:`DataParallel.passes`).

Where a rank runs is decided in one place, :func:`placement`: on the CPU every rank joins a
gloo group and computes on the CPU; on CUDA each rank takes its own GPU (``cuda:LOCAL_RANK``,
the rank on this machine) and the group is NCCL's. Nothing else differs between the two: the
collectives below take their tensors on :attr:`DataParallel.device`.

A check that stops an update before its optimiser step must decide the same on every rank:
a rank that stops alone leaves the others waiting in the next mini-batch's all-reduce (a
deadlock until the group's timeout), or steps them without it. The policy update checks
figures summed over the ranks and the summed gradients' norm, the same everywhere; the
critic's ``fit_values`` checks its rank's own loss, so it asks the ranks first
(:meth:`DataParallel.stopping`) and every rank stops when any would.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

Part = TypeVar("Part")


@dataclass(frozen=True)
class Placement:
    """Where one learner rank runs: its process group's ``backend`` and its ``device``."""

    backend: str
    device: torch.device


def placement(device: str, rank: int, world: int, local_rank: int | None = None) -> Placement:
    """The backend and the device of learner ``rank`` of ``world`` for a run on ``device``
    (the config's ``device``): on the CPU ``gloo`` and the CPU; on CUDA ``nccl`` and one GPU
    per rank, ``cuda:LOCAL_RANK`` (``local_rank``, else the ``LOCAL_RANK`` environment
    variable a launcher sets, else ``rank``: the ranks spawned on one machine), counted among
    the GPUs this process sees (``CUDA_VISIBLE_DEVICES``; Ray sets it to a worker's GPU ids).
    ValueError for another device type, a GPU index in ``device`` (rank 0 takes GPU 0), or
    fewer visible GPUs than ``world`` when the CUDA runtime can count them."""
    kind = torch.device(device)
    if kind.type == "cpu":
        return Placement("gloo", torch.device("cpu"))
    if kind.type != "cuda":
        raise ValueError(f"data-parallel learners run on cpu or cuda, not {device!r}")
    if kind.index not in (None, 0):
        raise ValueError(
            f"device={device!r}: learner ranks take one GPU each from GPU 0 (rank r on cuda:r); "
            "choose the GPUs with CUDA_VISIBLE_DEVICES and set device=cuda"
        )
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else None
    if visible is not None and visible < world:
        raise ValueError(
            f"cluster.learners={world} on CUDA needs one GPU per rank; this process sees "
            f"{visible} (CUDA_VISIBLE_DEVICES)"
        )
    return Placement("nccl", torch.device("cuda", local_rank))


class DataParallel:
    """This process's place among ``world`` data-parallel ranks (an initialised group);
    ``device``: where its collectives' own tensors go (:func:`placement`: the CPU for gloo,
    the rank's GPU for NCCL)."""

    def __init__(
        self,
        rank: int,
        world: int,
        sharded: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.rank, self.world, self.sharded = rank, world, sharded
        self.device = torch.device(device)
        self._wrapped: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's rows of a mini-batch ``rows[M]`` (every ``world``-th, from ``rank``)."""
        return rows[self.rank :: self.world]

    def wrap(
        self,
        module: torch.nn.Module,
        build: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    ) -> torch.nn.Module:
        """The module this rank's passes of ``module`` call, built on the first call and
        kept: ``build(module)`` (default: ``module`` itself; e.g. the policy's
        ``ScoringForward``), for replicas in a ``DistributedDataParallel`` that sums (not
        averages) the gradients over the ranks. Sharded ranks synchronise through FSDP and
        get no DDP. The first call is collective on replicas: every rank wraps the same
        modules in the same order (they run the same updates)."""
        key = id(module)
        if key not in self._wrapped:
            inner = module if build is None else build(module)
            if not self.sharded:
                inner = DistributedDataParallel(inner, forward_sync_buffers=False)
                inner.register_comm_hook(None, _sum_hook)
            self._wrapped[key] = (module, inner)  # the module kept alive: its id stays its own
        return self._wrapped[key][1]

    def passes(
        self, module: torch.nn.Module, parts: Sequence[Part], lockstep: int = 1
    ) -> Iterator[Part | None]:
        """Yield each of this rank's micro-batch ``parts`` of one mini-batch for the caller
        to run forward and backward through ``module`` (from :meth:`wrap`), then ``None``
        for each zero-weighted pass the ranks need: replicas synchronise on the last pass
        only (the others run under ``no_sync``), and need one pass at least; sharded ranks
        run ``lockstep`` passes in all, the busiest rank's count
        (:meth:`micro_batches`)."""
        total = lockstep if self.sharded else max(len(parts), 1)
        for i in range(total):
            last = i == total - 1
            defer = not last and isinstance(module, DistributedDataParallel)
            with module.no_sync() if defer else nullcontext():
                yield parts[i] if i < len(parts) else None

    def micro_batches(self, rows: int, micro_batch: int | None) -> int:
        """The forward/backward passes every sharded rank makes on a mini-batch of ``rows``
        rows in micro-batches of ``micro_batch`` (None: one per rank): the busiest rank's
        count, its share being the largest."""
        share = math.ceil(rows / self.world)  # rank 0's share, the largest
        return math.ceil(share / micro_batch) if micro_batch else 1

    def stopping(self, stop: bool) -> list[int]:
        """The ranks that vote to ``stop`` (this one's vote given), in order: the same list on
        every rank. Collective: one all-reduce (a sum) of a vector with each rank's flag in its
        own place."""
        votes = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        votes[self.rank] = int(stop)
        dist.all_reduce(votes)
        return [rank for rank, vote in enumerate(votes.tolist()) if vote]

    def sum_stats(self, stats: Mapping[str, float]) -> dict[str, float]:
        """The metrics' sums over the ranks (a rank may lack keys its rows did not produce)."""
        gathered: list[dict[str, float] | None] = [None] * self.world
        dist.all_gather_object(gathered, dict(stats))
        out: dict[str, float] = {}
        for part in gathered:
            for key, value in (part or {}).items():
                out[key] = out.get(key, 0.0) + value
        return out


def _sum_hook(state, bucket):  # unannotated on purpose: see the docstring
    """A DDP communication hook ``(state, dist.GradBucket) -> Future[Tensor]``: the bucket's
    gradients summed over the ranks (DDP's default divides the sum by the world size; the
    losses here are normalised by the whole mini-batch already). Unannotated: DDP checks
    the annotations as objects, which postponed annotations turn into strings."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def shard_model(
    model: torch.nn.Module, world: int, device: torch.device | None = None
) -> torch.nn.Module:
    """``model`` sharded in place over the ``world`` ranks of the default process group with
    FSDP2: each decoder layer (the classes the Hugging Face models in it name in
    ``_no_split_modules``: the policy itself, or a critic's backbone) is its own unit, the
    root holds the rest (embeddings, tied output layer, final norm, a value head);
    gradients are summed over the ranks, not averaged. Every rank must call it on the same
    model. ``device``: where the shards will live (the mesh's device type), needed when
    ``model`` is on the meta device; default the parameters' device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kind = (device or next(model.parameters()).device).type
    mesh = init_device_mesh(kind, (world,))
    units = {
        name
        for module in model.modules()
        for name in getattr(module, "_no_split_modules", None) or ()
    }
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in units:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model
