"""V0.5 in the trainer (arXiv 2603.10848): a prior per prompt, top-up rollouts where the
rollouts reject it, and the fused baseline. The knobs are in :mod:`.v05_config`.

Shapes: G prompts (groups) kept this step, B responses, k[G] responses per prompt (ragged
after top-ups).

    run start   V05          the prior; the `anchor` base reads PVPO's presampled anchors
                             (anchor_rl.trainer.pvpo, pvpo.m rollouts of the reference per
                             training prompt in the anchor store)
    each step   on_rollouts  between the filter and the log-probs (before PVPO's teacher
                             rows are injected, see below):
                 1 the prior predicts each prompt's expected reward V[G] (knn: from the
                   policy's mean-pooled hidden states of the prompt)
                 2 with rollout.budget = "adaptive": up to v05.top_up_rounds rounds, each
                   sampling in one engine call the extra rollouts algos.v05.extra_rollouts
                   asks for given every rollout so far (only prompts whose prior is
                   rejected get any; at most v05.k_max per prompt)
                 3 fusion of all the prompt's rollouts with V (algos.v05.fuse): b[G]
                 4 the prior learns the step's rewards, top-ups included
                advantage_inputs   ``baseline[B]``: b of each response's prompt; the
                             ``v05`` estimator's advantage is r - b (no std)

With PVPO's group sampling in the same run, V0.5 acts first: the fusion and the prior's
update see the policy's own rollouts only (top-ups included); a teacher row then replaces
one of them, and its prompt's baseline b is the one fused without it.

Rewards must lie in ``v05.reward_range``, the priors' units. ``sigma^2`` is the paper's
worst case ``((hi - lo)/2)^2`` or the Bernoulli variance at the prior ``(V - lo)(hi - V)``;
the budget's cost per rollout defaults to the paper's 0.0039 for +-1 rewards times
``((hi - lo)/2)^2``, which makes {0,1} rewards take exactly the +-1 decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from anchor_rl.algos import v05 as v05_math
from anchor_rl.anchors.priors import AnchorPrior, HistoryPrior, KNNPrior, Prior, prompt_embeddings
from anchor_rl.batch import RolloutBatch
from anchor_rl.methods.v05_config import V05Config
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
from anchor_rl.trainer.pvpo import PVPO, presample_anchors, write_presample_report
from anchor_rl.trainer.timing import Timer

PAPER_COST = 0.0039
"""The V0.5 paper's budget cost per rollout, for +-1 rewards."""
NEAR_ONE = 0.9
"""``v05/weight_near1_frac`` counts fusion weights at or above this."""


# --- fusion and budget on a step's rows ---------------------------------------------------


def group_means(rewards: Tensor, group: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """``(mean[G] float64, k[G] int64)`` of ``rewards[B]`` per group id ``group[B]`` in ``0..G-1``."""
    k = torch.bincount(group, minlength=groups)
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, rewards.double())
    return total / k.clamp(min=1), k


def sigma2_of(prior: Tensor, mode: str, reward_range: tuple[float, float]) -> Tensor:
    """Per-rollout reward variance ``[G]``: ``((hi - lo)/2)^2`` (``worst``) or ``(V - lo)(hi - V)``
    (``prior``)."""
    lo, hi = reward_range
    if mode == "worst":
        return torch.full_like(prior, ((hi - lo) / 2) ** 2)
    if mode == "prior":
        return ((prior - lo) * (hi - prior)).clamp(min=0)
    raise ValueError(f"unknown sigma2 mode {mode!r}; choose 'worst' or 'prior'")


def budget_sigma2(
    prior: Tensor, rejected: Tensor, mode: str, reward_range: tuple[float, float]
) -> Tensor:
    """Per-rollout reward variance ``[G]`` the budget (top-ups, estimated MSE) assumes: the
    test's (:func:`sigma2_of`), except in ``prior`` mode where the test ``rejected[G]`` the
    prior. The variance at V is the rewards' only if V is right, and it is 0 at V = lo or
    hi, so a rejected prior's prompt (often one the reference never solved) would get no
    top-up and an estimated MSE of 0 exactly where the prior is most wrong; there the
    budget takes the worst case, ``((hi - lo)/2)^2``."""
    sigma2 = sigma2_of(prior, mode, reward_range)
    if mode == "prior":
        sigma2 = torch.where(rejected, sigma2_of(prior, "worst", reward_range), sigma2)
    return sigma2


def budget_cost(vc: V05Config) -> float:
    """The budget rule's cost per rollout, in the reward units in use."""
    if vc.cost is not None:
        return vc.cost
    lo, hi = vc.reward_range
    return PAPER_COST * ((hi - lo) / 2) ** 2


@dataclass(frozen=True)
class Fusion:
    """One fusion of each prompt's rollouts with its prior; every field is ``[G]``.

    emp_mean: mean reward of the prompt's k rollouts (float64); k: rollouts (int64);
    prior: V; sigma2: the per-rollout variance of the test and the fusion; baseline: ``V +
    weight * (emp_mean - V)``; weight: the weight on the empirical mean; rejected:
    ``(emp_mean - V)^2 > sigma2 / k``; budget_sigma2: the variance the budget assumes
    (:func:`budget_sigma2`); est_mse: the baseline's estimated MSE
    (``algos.v05.estimated_mse`` with ``budget_sigma2``).
    """

    emp_mean: Tensor
    k: Tensor
    prior: Tensor
    sigma2: Tensor
    baseline: Tensor
    weight: Tensor
    rejected: Tensor
    budget_sigma2: Tensor
    est_mse: Tensor


def fuse_groups(rewards: Tensor, group: Tensor, prior: Tensor, vc: V05Config) -> Fusion:
    """Fuse the rewards of each group (``rewards[B]``, ``group[B]`` in ``0..G-1``) with ``prior[G]``."""
    prior = prior.double()
    emp, k = group_means(rewards, group, len(prior))
    if bool((k == 0).any()):
        raise ValueError(f"groups {(k == 0).nonzero().flatten().tolist()} have no rollout")
    s2 = sigma2_of(prior, vc.sigma2, vc.reward_range)
    baseline, weight, rejected = v05_math.fuse(emp, k, prior, s2)
    budget = budget_sigma2(prior, rejected, vc.sigma2, vc.reward_range)
    est = v05_math.estimated_mse(emp, k, prior, budget)
    return Fusion(emp, k, prior, s2, baseline, weight, rejected, budget, est)


def extra_counts(fusion: Fusion, vc: V05Config) -> Tensor:
    """More rollouts each prompt asks for, ``[G]`` int64: 0 where the prior is accepted, at most
    ``k_max - k``."""
    return v05_math.extra_rollouts(
        fusion.emp_mean, fusion.k, fusion.prior, fusion.budget_sigma2, budget_cost(vc), vc.k_max
    )


def check_rewards(rewards: Tensor, vc: V05Config) -> None:
    """ValueError naming ``v05.reward_range`` when a reward lies outside it."""
    lo, hi = vc.reward_range
    bad = (rewards < lo) | (rewards > hi) | rewards.isnan()
    if bool(bad.any()):
        raise ValueError(
            f"rewards {sorted(set(rewards[bad].tolist()))[:5]} lie outside v05.reward_range "
            f"[{lo}, {hi}]; set it to the training reward's range (reward shaping such as "
            "reward.overlong_cache widens it)"
        )


# --- the prior ---------------------------------------------------------------------------


def uses_anchors(vc: V05Config) -> bool:
    """Whether the prior's base is PVPO's static anchor."""
    return vc.prior.split("+")[0] == "anchor"


def uses_embeddings(vc: V05Config) -> bool:
    """Whether the prior reads prompt embeddings (the knn base)."""
    return vc.prior.split("+")[0] == "knn"


def build_prior(vc: V05Config, anchors: Mapping[str, float] | None = None) -> Prior:
    """The prior ``v05.prior`` names; ``anchors`` (prompt id -> reference mean) for ``anchor``."""
    base_name, _, layered = vc.prior.partition("+")
    rr = vc.reward_range
    base: Prior | None = None
    if base_name == "anchor":
        if anchors is None:
            raise ValueError("the anchor prior needs the presampled anchors")
        base = AnchorPrior(anchors, reward_range=rr)
    elif base_name == "knn":
        base = KNNPrior(
            window=vc.knn_window,
            top_k=vc.knn_top_k,
            temperature=vc.knn_temperature,
            reward_range=rr,
        )
    if base is None or layered:
        return HistoryPrior(base, vc.history_strength, vc.history_gamma, reward_range=rr)
    return base


def first_rows(group: Tensor, groups: int) -> list[int]:
    """Index of the first row of each group ``0..G-1`` in ``group[B]``."""
    first: dict[int, int] = {}
    for row, g in enumerate(group.tolist()):
        first.setdefault(g, row)
    return [first[g] for g in range(groups)]


def embed_groups(model: PreTrainedModel, batch: RolloutBatch, groups: int) -> Tensor:
    """``[G, D]``: each group's prompt (the token ids it was sampled from) embedded by ``model``."""
    rows = first_rows(batch.group, groups)
    return prompt_embeddings(model, None, [batch.prompt_ids[r] for r in rows])


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
    prior: Tensor,
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
        extra = extra_counts(fuse_groups(scored.rewards, scored.batch.group, prior, vc), vc)
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


def fusion_metrics(first: Fusion, last: Fusion, rounds: int) -> dict[str, float]:
    """``v05/*``: ``first`` is the fusion at k_init, ``last`` the one the baseline comes from."""
    return {
        "v05/prior_mean": first.prior.mean().item(),
        "v05/prior_gap": (first.emp_mean - first.prior).abs().mean().item(),
        "v05/rejected_init_frac": first.rejected.double().mean().item(),
        "v05/rejected_frac": last.rejected.double().mean().item(),
        "v05/extra_rollouts": float((last.k - first.k).sum()),
        "v05/topped_up_frac": (last.k > first.k).double().mean().item(),
        "v05/top_up_rounds": float(rounds),
        "v05/rollouts_per_prompt": last.k.double().mean().item(),
        "v05/weight_mean": last.weight.mean().item(),
        "v05/weight_zero_frac": (last.weight == 0).double().mean().item(),
        "v05/weight_near1_frac": (last.weight >= NEAR_ONE).double().mean().item(),
        "v05/baseline_mean": last.baseline.mean().item(),
        "v05/estimated_mse": last.est_mse.mean().item(),
    }


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
        self.prior = build_prior(cfg.v05, self.anchors)

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
        check_rewards(scored.rewards, vc)
        ids = [r.id for r in scored.records]
        emb = embed_groups(self.policy, scored.batch, g) if uses_embeddings(vc) else None
        prior = self.prior.predict(ids, emb)
        first = fuse_groups(scored.rewards, scored.batch.group, prior, vc)
        added: list[Scored] = []
        if cfg.rollout.budget == "adaptive":
            scored, added = top_up(self.engine, self.task, cfg, scored, prior, step.timer)
            check_rewards(scored.rewards, vc)
        last = fuse_groups(scored.rewards, scored.batch.group, prior, vc) if added else first
        group = scored.batch.group
        self.prior.update(ids, [scored.rewards[group == i] for i in range(g)], emb)
        step.metrics = pool_response_metrics(step.metrics, added) | fusion_metrics(
            first, last, len(added)
        )
        step.scored, self.fused = scored, last.baseline.float()

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """``baseline[B]``: the fused baseline of each response's prompt."""
        if self.fused is None:
            return {}
        return {"baseline": self.fused[step.scored.batch.group]}

    def state_dict(self) -> dict[str, Any]:
        return {"prior": self.prior.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prior.load_state_dict(state["prior"])

    def counters(self) -> dict[str, float]:
        if self.presample_rollouts is None:
            return {}
        return {"rollouts/presample": float(self.presample_rollouts)}
