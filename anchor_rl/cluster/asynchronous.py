"""Asynchronous rollouts (``cluster.async_steps = k``): the next ``k`` steps' rollouts are
sampled while this step's update runs, up to ``k`` steps off-policy, as verl's
one-step-off-policy recipe (``k = 1``) and OpenRLHF's async mode do.

Within a step the loop (:mod:`anchor_rl.trainer.loop`) collects its rollouts, then asks
:class:`PrefetchingEngine` to have the first rollout call of each of the next ``k`` steps
sent (the next ``k * prompts_per_step`` prompts of the stream, seeded as ever; calls sent
by earlier steps stay pending and only the newest is added) before it scores log-probs and
updates. The Ray workers sample them with the weights they hold, the ones before this
update; the update's ``sync_weights`` reaches each worker after those rollouts (a worker
runs its calls in order). A later step's ``collect`` makes the same call and gets the
prefetched batch, sampled ``k`` updates earlier at most. Any call with the arguments of a
queued one gets its batch, whoever makes it: a second round of dynamic sampling draws the
next ``prompts_per_step`` prompts of the stream, which are the next step's queued call when
``k >= 2``, so rounds ``2..k`` of a step are served the queued (older-weights) batches and
only later rounds are sampled at once; ``async/staleness`` counts them, and their ratio
divides by the log-probs they were sampled with, as for any prefetched batch. With
``k = 1`` no round after the first is queued. Other calls (a V0.5 top-up, an evaluation)
are sampled at once with the current weights, and a prefetch the stream has moved past
(dynamic sampling drew extra prompts) is discarded.

A rollout worker that dies holding a prefetched call is replaced with the last synced
weights (:mod:`anchor_rl.cluster.engine`): when an update's sync came between the sending
and the death, the dead worker's shard is sampled again with those newer weights. Its rows
carry those weights' log-probs, which the ratio divides by, so the update stays consistent;
they are fresher than ``async/staleness`` (the largest over the batch's rows) says.

A prefetched batch is stale, so the ratio's denominator is the behaviour log-probs the
engine returned with the tokens (the log-probs of the weights that sampled them; at
``top_p = 1`` they are the model's, temperature-scaled as the update's), on every row.
With ``cluster.async_correction = "tis"`` the denominator is instead the current policy's
log-probs (recomputed before the update) and each token's advantage is weighted by the
truncated importance ratio ``min(pi_current / pi_behaviour, cluster.tis_cap)``, the
token-level truncated importance sampling of verl's rollout correction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, astuple
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
    rollout calls ahead: :meth:`prefetch` sends one, and the :meth:`rollout` call with the
    same arguments collects it.

    staleness: weight syncs between the sending and the collecting of the batches
        :meth:`rollout` returned since :meth:`take_staleness` last read it (the largest).
    prefetched: prefetched calls collected; discarded: prefetched calls never collected
        (their rollouts were sampled but not trained on); :meth:`take_discarded` counts
        their responses, a cost the run adds to its rollouts.
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
        self._discarded_responses = 0
        # (key, handle, syncs when sent, responses), in sent order
        self._pending: deque[tuple[tuple, Any, int, int]] = deque()

    @property
    def pending(self) -> int:
        """Prefetched calls sent and not collected yet."""
        return len(self._pending)

    def prefetch(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> None:
        """Start ``rollout(requests, params, tools, instruction)`` now, with the workers'
        current weights; a call already pending is not sent again."""
        key = _key(requests, params, tools, instruction)
        if any(pending[0] == key for pending in self._pending):
            return
        handle = self.engine.submit(requests, params, tools, instruction)
        self._pending.append((key, handle, self.syncs, len(requests)))

    def retain(self, calls: Sequence[tuple]) -> None:
        """Discard the pending prefetches that are none of ``calls`` (``rollout``'s positional
        arguments): the ones the prompt stream has moved past."""
        wanted = {_key(*call) for call in calls}
        self._drop([p for p in self._pending if p[0] not in wanted])

    def rollout(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        tools: Mapping[str, Tool] | None = None,
        instruction: str | None = None,
    ) -> RolloutBatch:
        """The prefetched batch when the arguments are a prefetched call's, else a rollout
        sampled now (see :class:`~anchor_rl.rollout.engine.Engine`)."""
        key = _key(requests, params, tools, instruction)
        for i, (pending_key, handle, sent_at, _) in enumerate(self._pending):
            if pending_key == key:
                del self._pending[i]
                self.prefetched += 1
                self.staleness = max(self.staleness, self.syncs - sent_at)
                return handle.result()
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
        """Drop the prefetches not collected (the run ended before the steps that would use
        them)."""
        self._drop(list(self._pending))

    def take_discarded(self) -> int:
        """Responses of the discarded prefetches since the last call (0 then)."""
        count, self._discarded_responses = self._discarded_responses, 0
        return count

    def _drop(self, dropped: list[tuple[tuple, Any, int, int]]) -> None:
        self.discarded += len(dropped)
        self._discarded_responses += sum(p[3] for p in dropped)
        gone = {id(p) for p in dropped}
        self._pending = deque(p for p in self._pending if id(p) not in gone)

    def state_dict(self) -> dict[str, Any]:
        """The pending prefetches as plain data for a checkpoint: each call's key, its batch
        (waited for: the workers finish sampling it first) and its age in weight syncs, so
        a resumed run collects the very batches the uninterrupted run would have."""
        calls = []
        for i, (key, handle, sent_at, responses) in enumerate(self._pending):
            batch = handle.result()
            self._pending[i] = (key, _Done(batch), sent_at, responses)
            requests, params, tools, instruction = key
            calls.append({
                "requests": [list(astuple(r)) for r in requests], "params": params,
                "tools": list(tools), "instruction": instruction, "batch": asdict(batch),
                "age": self.syncs - sent_at,
            })  # fmt: skip
        return {"pending": calls}

    def load_state_dict(self, state: Mapping[str, Any], max_staleness: int | None = None) -> None:
        """Queue a checkpoint's prefetches (:meth:`state_dict`) as collected batches of the
        same age, ahead of any sent since.

        max_staleness: the resumed run's ``cluster.async_steps``. The i-th queued batch is
        collected after i more weight syncs, so its staleness then is its age plus i; the
        ones that would exceed the bound (a run resumed with a smaller ``async_steps``) are
        discarded, as passed-by prefetches are (their steps sample afresh)."""
        restored, stale = [], []
        for i, call in enumerate(state["pending"]):
            requests = tuple(Request(*r) for r in call["requests"])
            key = (requests, call["params"], tuple(call["tools"]), call["instruction"])
            batch = RolloutBatch(**call["batch"])
            entry = (key, _Done(batch), self.syncs - call["age"], len(requests))
            too_old = max_staleness is not None and call["age"] + i > max_staleness
            (stale if too_old else restored).append(entry)
        self._pending = deque([*restored, *self._pending])
        self._drop(stale)  # counted as discarded (never queued)

    def __getattr__(self, name: str) -> Any:  # workers, pids, restarts, ... of the inner engine
        return getattr(self.engine, name)


class _Done:
    """A prefetch whose batch is in hand (``result()``, as a pending call's)."""

    def __init__(self, batch: RolloutBatch) -> None:
        self.batch = batch

    def result(self) -> RolloutBatch:
        return self.batch


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
