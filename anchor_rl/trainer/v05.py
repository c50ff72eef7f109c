"""V0.5 in the trainer: the :class:`V05` component over :mod:`anchor_rl.methods.v05`.

Shapes: G prompts (groups) kept this step, B responses, k[G] responses per prompt (ragged
after top-ups).

    run start   V05          the prior; the `anchor` base reads PVPO's presampled anchors
                             (pvpo.m rollouts of the reference per training prompt in the
                             anchor store)
    each step   on_rollouts  between the filter and the log-probs (before PVPO's teacher
                             rows are injected, see below): ``V05Step.begin`` (the prior's
                             prediction), with rollout.budget = "adaptive" up to
                             v05.top_up_rounds rounds of top-ups (:func:`top_up`, one engine
                             call each), ``V05Step.finish`` (fusion, the prior's update)
                advantage_inputs   ``baseline[B]``: b of each response's prompt; the
                             ``v05`` estimator's advantage is r - b (no std)

With PVPO's group sampling in the same run, V0.5 acts first: the fusion and the prior's
update see the policy's own rollouts only (top-ups included); a teacher row then replaces
one of them, and its prompt's baseline b is the one fused without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from anchor_rl.batch import RolloutBatch
from anchor_rl.methods.v05 import V05Step, build_prior, embed_groups, uses_anchors, uses_embeddings
from anchor_rl.rollout.engine import Engine
from anchor_rl.tasks.base import Record, Task
from anchor_rl.trainer.collect import (
    Scored,
    collect_metrics,
    sampling_params,
    score,
    train_requests,
)
from anchor_rl.trainer.component import Component, Setup, Step
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.perfect import UNCOUNTED, PerfectPrior, policy_values
from anchor_rl.trainer.pvpo import PVPO, presample_anchors, write_presample_report
from anchor_rl.trainer.timing import Timer

# --- top-up rollouts ---------------------------------------------------------------------


def merge_rows(a: Scored, b: Scored) -> Scored:
    """The rows of ``a`` and ``b`` (group ids indexing the same records), sorted by group;
    within a group ``a``'s rows come first, each part in its own order."""
    batch = RolloutBatch.cat([a.batch, b.batch])
    order = torch.argsort(batch.group, stable=True)

    def cat(name: str) -> Tensor:
        return torch.cat([getattr(a, name), getattr(b, name)])[order]

    return dataclasses.replace(
        a,
        batch=batch.select(order),
        rewards=cat("rewards"),
        task_rewards=cat("task_rewards"),
        correct=cat("correct"),
        off_policy=cat("off_policy"),
    )


def top_up(
    engine: Engine,
    task: Task,
    cfg: TrainConfig,
    scored: Scored,
    v05: V05Step,
    timer: Timer,
) -> tuple[Scored, list[Scored]]:
    """Adaptive budget: up to ``v05.top_up_rounds`` rounds of extra rollouts.

    Before each round the budget rule (:func:`extra_counts`) is evaluated on every rollout
    so far; the round samples every prompt's extras in one engine call. A prompt's extras
    continue its sample numbering (:func:`~anchor_rl.trainer.collect.train_requests`: the
    k-th rollout of a prompt has the same seed whether it was sampled first or topped up).
    It stops early when no prompt asks for more.

    Returns the merged rows (ragged groups, sorted by group) and the rows each round added.
    """
    if scored.draws is None:
        raise ValueError("top-ups need the stream positions of the prompts (Scored.draws)")
    vc, added = cfg.v05, []
    for _ in range(vc.top_up_rounds):
        extra = v05.extra(vc, scored.rewards, scored.batch.group)
        if not bool(extra.any()):
            break
        have = torch.bincount(scored.batch.group, minlength=len(scored.records))
        wanted = extra.nonzero().flatten().tolist()
        requests = [
            request
            for g in wanted
            for request in train_requests(
                [scored.records[g]],
                [scored.draws[g]],
                int(extra[g]),
                cfg.seed,
                first=int(have[g]),
            )  # fmt: skip
        ]
        with timer("generate"):
            batch = engine.rollout(
                requests, sampling_params(cfg, task), tools=task.tools or None,
                instruction=task.instruction,
            )  # fmt: skip
        batch.group = torch.arange(len(extra)).repeat_interleave(extra)
        with timer("score"):
            new = score(task, batch, scored.records, cfg)
        added.append(new)
        scored = merge_rows(scored, new)
    return scored, added


# --- metrics -----------------------------------------------------------------------------

_MEAN_KEYS = (
    "reward/mean",
    "reward/shaped_mean",
    "accuracy",
    "response/length",
    "response/truncated_frac",
    "response/tool_calls",
)


def pool_response_metrics(
    metrics: Mapping[str, float], parts: Sequence[Scored]
) -> dict[str, float]:
    """``metrics`` (collect's, over the responses it generated) extended to the top-up rows
    ``parts``: pooled means, maximum and unbiased std, summed counts (exact)."""
    out = dict(metrics)
    for part in parts:
        add = collect_metrics(part, part, 1)
        n0, n1 = out["rollouts/step"], add["rollouts/step"]
        n = n0 + n1
        m0, m1 = out["reward/mean"], add["reward/mean"]
        squares = (n0 - 1) * out["reward/std"] ** 2 + n0 * m0**2
        squares += (n1 - 1) * add["reward/std"] ** 2 + n1 * m1**2
        for key in _MEAN_KEYS:
            out[key] = (n0 * out[key] + n1 * add[key]) / n
        out["reward/std"] = math.sqrt(max(0.0, (squares - n * out["reward/mean"] ** 2) / (n - 1)))
        out["response/length_max"] = max(out["response/length_max"], add["response/length_max"])
        out["rollouts/step"] = n
        out["tokens/step"] += add["tokens/step"]
    return out


# --- the stage ---------------------------------------------------------------------------


class V05(Component):
    """V0.5's prior, top-up rollouts and fused baseline in a run (see the module docstring).

    prior: the prior; it learns each step's rewards and is checkpointed (plain data).
    anchors: prompt id -> the reference's mean reward (PVPO's ``V_sta``) of the training
        prompts, when the prior's base is the anchor; None otherwise.
    records: the training prompts (after PVPO's group sampling when the run has it).
    """

    name = "v05"

    def __init__(self, setup: Setup, pvpo: PVPO | None = None) -> None:
        """The ``anchor`` base takes the anchors of ``pvpo`` when the run has that component,
        and otherwise presamples them the way PVPO does (``pvpo.m`` rollouts of the
        reference on the prompts ``pvpo.prompts`` names, rows reused from ``pvpo.store``;
        their cost is this component's ``rollouts/presample``) and trains on those."""
        cfg = setup.cfg
        self.cfg, self.task, self.policy = cfg, setup.task, setup.policy
        self.engine = setup.engine
        self.records = pvpo.records if pvpo is not None else list(setup.records)
        self.anchors: dict[str, float] | None = None
        self.presample_rollouts: int | None = None
        self.fused: Tensor | None = None  # [G] the step's fused baseline per group
        if uses_anchors(cfg.v05):
            if pvpo is not None:
                self.anchors = {pid: stat.mean for pid, stat in pvpo.anchors.items()}
            else:
                anchor_set = presample_anchors(setup)
                self.records = anchor_set.pool(anchor_set.records)
                if not setup.resuming:
                    write_presample_report(setup.run_dir, cfg, anchor_set, self.records, None)
                self.anchors = anchor_set.means()
                self.presample_rollouts = anchor_set.rollouts
        self.uncounted = 0  # v05.prior = "perfect": its extra samples (rollouts/uncounted)
        perfect = cfg.v05.prior == "perfect"
        self.prior = (
            PerfectPrior(cfg.v05.reward_range) if perfect else build_prior(cfg.v05, self.anchors)
        )

    def training_records(self, records: list[Record]) -> list[Record]:
        return self.records

    def on_rollouts(self, step: Step) -> None:
        """Prior -> top-up rounds -> fusion -> prior update, on the kept groups.

        Replaces ``step.scored`` by the rows with the top-ups merged in (sorted by group),
        pools the top-up responses into the response statistics and counts, and adds
        ``v05/*``. The fused baseline of each group is kept for :meth:`advantage_inputs`.
        """
        self.fused = None
        scored = step.scored
        if len(scored) == 0:
            return
        cfg = self.cfg
        vc, g = cfg.v05, len(scored.records)
        emb = embed_groups(self.policy, scored.batch, g) if uses_embeddings(vc) else None
        ids = [r.id for r in scored.records]
        if isinstance(self.prior, PerfectPrior):  # this step's estimate, uncounted samples
            values, extra = policy_values(self.engine, self.task, cfg, scored, cfg.perfect.samples)
            self.prior.set(ids, values)
            self.uncounted += cfg.perfect.samples * g
            step.metrics |= extra
        v05 = V05Step.begin(self.prior, vc, ids, scored.rewards, scored.batch.group, emb)
        added: list[Scored] = []
        if cfg.rollout.budget == "adaptive":
            scored, added = top_up(self.engine, self.task, cfg, scored, v05, step.timer)
        self.fused, _, metrics = v05.finish(
            self.prior, vc, scored.rewards, scored.batch.group, len(added)
        )
        step.metrics = pool_response_metrics(step.metrics, added) | metrics
        step.scored = scored

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """``baseline[B]``: the fused baseline of each response's prompt."""
        if self.fused is None:
            return {}
        return {"baseline": self.fused[step.scored.batch.group]}

    def state_dict(self) -> dict[str, Any]:
        return {"prior": self.prior.state_dict(), "uncounted": self.uncounted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prior.load_state_dict(state["prior"])
        self.uncounted = int(state.get("uncounted", 0))

    def counters(self) -> dict[str, float]:
        out = {UNCOUNTED: float(self.uncounted)} if isinstance(self.prior, PerfectPrior) else {}
        if self.presample_rollouts is not None:
            out["rollouts/presample"] = float(self.presample_rollouts)
        return out
