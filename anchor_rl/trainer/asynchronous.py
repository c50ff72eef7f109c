"""Asynchronous rollouts (``cluster.async_steps = 1``): the next step's rollouts are sampled
while this step's update runs, one step off-policy, as verl's one-step-off-policy recipe
and OpenRLHF's async mode do.

Within a step the loop (:mod:`anchor_rl.trainer.loop`) collects its rollouts, then asks
:class:`PrefetchingEngine` to start the next step's first rollout call (the next
``prompts_per_step`` prompts of the stream, seeded as ever) before it scores log-probs and
updates. The Ray workers sample it with the weights they hold, the ones before this
update; the update's ``sync_weights`` reaches each worker after that rollout (a worker runs
its calls in order). The next step's ``collect`` makes the same call and gets the
prefetched batch; any other call (a second round of dynamic sampling, a V0.5 top-up, an
evaluation) is sampled at once with the current weights.

A prefetched batch is stale by one update, so the ratio's denominator is the behaviour
log-probs the engine returned with the tokens (the log-probs of the weights that sampled
them; at ``top_p = 1`` they are the model's, temperature-scaled as the update's), on every
row. With ``cluster.async_correction = "tis"`` the denominator is instead the current
policy's log-probs (recomputed before the update) and each token's advantage is weighted by
the truncated importance ratio ``min(pi_current / pi_behaviour, cluster.tis_cap)``, the
token-level truncated importance sampling of verl's rollout correction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from anchor_rl.batch import RolloutBatch
from anchor_rl.rollout.engine import Engine, Request
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tools.base import Tool


def _key(
    requests: Sequence[Request],
    params: SamplingParams,
    tools: Mapping[str, Tool] | None,
    instruction: str | None,
) -> tuple:
    return tuple(requests), repr(params), tuple(sorted(tools or {})), instruction


class PrefetchingEngine:
    """An engine with ``submit`` (:class:`~anchor_rl.cluster.engine.RayEngine`) that can start
    one rollout call ahead: :meth:`prefetch` sends it, and the :meth:`rollout` call with the
    same arguments collects it.

    staleness: weight syncs between the sending and the collecting of the batches
        :meth:`rollout` returned since :meth:`take_staleness` last read it (the largest).
    prefetched: prefetched calls collected; discarded: prefetched calls never collected
        (their rollouts were sampled but not trained on).
    """

    def __init__(self, engine: Engine) -> None:
        if not callable(getattr(engine, "submit", None)):
            raise ValueError(
                f"asynchronous rollouts need an engine that can submit work and return "
                f"(the ray engine, cluster.rollout_workers > 0), not {type(engine).__name__}"
            )
        self.engine = engine
        self.syncs = 0
        self.staleness = 0
        self.prefetched = self.discarded = 0
        self._pending: tuple[tuple, Any, int] | None = None

    def prefetch(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> None:
        """Start ``rollout(requests, params, tools, instruction)`` now, with the workers'
        current weights (a prefetch not collected yet is discarded)."""
        if self._pending is not None:
            self.discarded += 1
        handle = self.engine.submit(requests, params, tools, instruction)
        self._pending = (_key(requests, params, tools, instruction), handle, self.syncs)

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """The prefetched batch when the arguments are the prefetched call's, else a rollout
        sampled now (see :class:`~anchor_rl.rollout.engine.Engine`)."""
        pending = self._pending
        if pending is not None and pending[0] == _key(requests, params, tools, instruction):
            self._pending = None
            self.prefetched += 1
            self.staleness = max(self.staleness, self.syncs - pending[2])
            return pending[1].result()
        return self.engine.rollout(requests, params, tools, instruction)

    def sync_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """The inner engine's ``sync_weights`` (after any prefetched rollout, on each worker)."""
        self.engine.sync_weights(state)
        self.syncs += 1

    def take_staleness(self) -> int:
        """:attr:`staleness`, reset to 0."""
        staleness, self.staleness = self.staleness, 0
        return staleness

    def discard(self) -> None:
        """Drop a prefetch not collected (the run ended before the step that would use it)."""
        if self._pending is not None:
            self._pending = None
            self.discarded += 1

    def __getattr__(self, name: str) -> Any:  # workers, pids, restarts, ... of the inner engine
        return getattr(self.engine, name)


def truncated_is_weights(
    logp: Tensor, behaviour: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Token-level truncated importance weights ``min(exp(logp - behaviour), cap)``, 0 off
    ``mask`` (all ``[B, T]``), and their metrics over the masked tokens (mean, share capped)."""
    ratio = torch.exp((logp - behaviour) * mask)
    weights = ratio.clamp(max=cap) * mask
    tokens = mask.sum().clamp(min=1)
    return weights, {
        "async/tis_weight_mean": float((weights.sum() / tokens).item()),
        "async/tis_capped_frac": float((((ratio > cap).float() * mask).sum() / tokens).item()),
    }
