"""Data parallelism over torch.distributed ranks: what each rank does inside one update.

Every rank holds the whole step's batch and the same mini-batch schedule. For each
mini-batch a rank backpropagates its share of the rows (rows ``rank, rank + world, ...``)
with the *mini-batch's* loss normalisers (its token and sequence counts, which every rank
computes from the whole mini-batch), so the per-rank gradients sum to the gradient of the
whole mini-batch's loss: a token-mean over 2 ranks is the token-mean over the batch, not the
mean of two means. :meth:`DataParallel.sum_grads` all-reduces them before the step, and the
step's metrics are summed the same way. Every rank then takes the same optimiser step, so
the replicas stay equal (tested), and rank 0's weights are the run's.

With ``cluster.learner_sharding = "fsdp"`` the ranks hold FSDP2 shards instead of replicas
(:func:`shard_policy`): FSDP reduce-scatters the gradients itself, summed as above (its
divide factor set to 1), and every forward all-gathers a layer's parameters from every
rank, so the ranks run their forward and backward passes in lockstep: a rank whose share
of a mini-batch has fewer micro-batches than another's runs a zero-weighted pass for each
missing one (:meth:`DataParallel.micro_batches`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor


class DataParallel:
    """This process's place among ``world`` data-parallel ranks (an initialised group)."""

    def __init__(self, rank: int, world: int, sharded: bool = False) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.rank, self.world, self.sharded = rank, world, sharded

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's rows of a mini-batch ``rows[M]`` (every ``world``-th, from ``rank``)."""
        return rows[self.rank :: self.world]

    def micro_batches(self, rows: int, micro_batch: int | None) -> int | None:
        """The forward/backward passes every rank makes on a mini-batch of ``rows`` rows in
        micro-batches of ``micro_batch`` (None: one per rank) when the ranks run in lockstep
        (``sharded``): the busiest rank's count. None when they need not."""
        if not self.sharded:
            return None
        share = math.ceil(rows / self.world)  # rank 0's share, the largest
        return math.ceil(share / micro_batch) if micro_batch else 1

    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace every parameter's gradient by its sum over the ranks (one all-reduce of a
        flat buffer; a parameter a rank did not reach counts as zero there). Sharded ranks
        have them summed already (FSDP's reduce-scatter)."""
        if self.sharded:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        start = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[start : start + n].view_as(p.grad))
            start += n

    def sum_stats(self, stats: Mapping[str, float]) -> dict[str, float]:
        """The metrics' sums over the ranks (a rank may lack keys its rows did not produce)."""
        gathered: list[dict[str, float] | None] = [None] * self.world
        dist.all_gather_object(gathered, dict(stats))
        out: dict[str, float] = {}
        for part in gathered:
            for key, value in (part or {}).items():
                out[key] = out.get(key, 0.0) + value
        return out


def shard_policy(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """``model`` sharded in place over the ``world`` ranks of the default process group with
    FSDP2: each decoder layer (the classes a Hugging Face model names in
    ``_no_split_modules``) is its own unit, the root holds the rest (embeddings, tied output
    layer, final norm); gradients are summed over the ranks, not averaged. Every rank must
    call it on the same model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (world,))
    units = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in units:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model
