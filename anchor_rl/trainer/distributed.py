"""Data parallelism over torch.distributed ranks: what each rank does inside one update.

Every rank holds the whole step's batch and the same mini-batch schedule. For each
mini-batch a rank backpropagates its share of the rows (rows ``rank, rank + world, ...``)
with the *mini-batch's* loss normalisers (its token and sequence counts, which every rank
computes from the whole mini-batch), so the per-rank gradients sum to the gradient of the
whole mini-batch's loss: a token-mean over 2 ranks is the token-mean over the batch, not the
mean of two means. :meth:`DataParallel.sum_grads` all-reduces them before the step, and the
step's metrics are summed the same way. Every rank then takes the same optimiser step, so
the replicas stay equal (tested), and rank 0's weights are the run's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor


class DataParallel:
    """This process's place among ``world`` data-parallel ranks (an initialised group)."""

    def __init__(self, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.rank, self.world = rank, world

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's rows of a mini-batch ``rows[M]`` (every ``world``-th, from ``rank``)."""
        return rows[self.rank :: self.world]

    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace every parameter's gradient by its sum over the ranks (one all-reduce of a
        flat buffer; a parameter a rank did not reach counts as zero there)."""
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
