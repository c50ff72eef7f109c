"""V0.5 (arXiv 2603.10848), written once for every host: the prior, the real-time test of
the prior, the fused baseline and the rollout budget.

Shapes: G prompts (groups) of a step, B responses, ``group[B]`` each response's prompt in
``0..G-1``, ``k[G]`` responses per prompt (ragged after top-ups).

One step on a host (the native :class:`~anchor_rl.trainer.v05.V05` component, the TRL and
verl plug-ins) is :class:`V05Step`::

    begin    the prior predicts each prompt's expected reward V[G] (knn: from the policy's
             mean-pooled hidden states of the prompt); the fusion on the first rollouts
    extra    with an adaptive budget, the extra rollouts each prompt asks for given every
             rollout so far (only prompts whose prior is rejected get any; at most k_max)
    finish   the fusion of all the prompt's rollouts with V (positive-part James-Stein,
             :func:`anchor_rl.algos.v05.fuse`): the baseline b[G]; the prior learns the
             step's rewards; the ``v05/*`` metrics

Rewards must lie in ``v05.reward_range``, the priors' units. ``sigma^2`` is the paper's
worst case ``((hi - lo)/2)^2`` or the Bernoulli variance at the prior ``(V - lo)(hi - V)``;
the budget's cost per rollout defaults to the paper's 0.0039 for +-1 rewards times
``((hi - lo)/2)^2``, which makes {0,1} rewards take exactly the +-1 decisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from anchor_rl.algos import v05 as v05_math
from anchor_rl.anchors.priors import AnchorPrior, HistoryPrior, KNNPrior, Prior, prompt_embeddings
from anchor_rl.batch import RolloutBatch
from anchor_rl.methods.groups import first_rows
from anchor_rl.methods.v05_config import V05Config

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


def embed_groups(model: PreTrainedModel, batch: RolloutBatch, groups: int) -> Tensor:
    """``[G, D]``: each group's prompt (the token ids it was sampled from) embedded by ``model``."""
    rows = first_rows(batch.group, groups)
    return prompt_embeddings(model, None, [batch.prompt_ids[r] for r in rows])


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


@dataclass
class V05Step:
    """V0.5 on one step's G prompts, from the prior's prediction to the fused baseline.

    ids: the prompts' keys in the prior ``[G]``; embeddings: ``[G, D]`` for the knn prior, else
    None; prior: the prediction ``V[G]`` before any rollout of the step; first: the fusion on
    the first rollouts.
    """

    ids: list[str]
    prior: Tensor
    first: Fusion
    embeddings: Tensor | None = None

    @classmethod
    def begin(
        cls,
        model: Prior,
        vc: V05Config,
        ids: Sequence[str],
        rewards: Tensor,
        group: Tensor,
        embeddings: Tensor | None = None,
    ) -> V05Step:
        """Check ``rewards[B]``, predict each prompt's value, fuse the first rollouts."""
        check_rewards(rewards, vc)
        prior = model.predict(list(ids), embeddings)
        return cls(list(ids), prior, fuse_groups(rewards, group, prior, vc), embeddings)

    def extra(self, vc: V05Config, rewards: Tensor, group: Tensor) -> Tensor:
        """More rollouts each prompt asks for, ``[G]`` int64, given every rollout so far."""
        check_rewards(rewards, vc)
        return extra_counts(fuse_groups(rewards, group, self.prior, vc), vc)

    def finish(
        self,
        model: Prior,
        vc: V05Config,
        rewards: Tensor,
        group: Tensor,
        rounds: int,
        **update: bool,
    ) -> tuple[Tensor, Fusion, dict[str, float]]:
        """``(baseline[G] float32, fusion, v05/* metrics)`` on every rollout of the step
        (``rewards[B]``, ``group[B]`` in the host's row order; ``rounds`` top-up rounds ran),
        after which the prior learns the rewards (``update`` passes on to
        :meth:`Prior.update`)."""
        check_rewards(rewards, vc)
        last = fuse_groups(rewards, group, self.prior, vc)
        groups = [rewards[group == i] for i in range(len(self.ids))]
        model.update(self.ids, groups, self.embeddings, **update)
        return last.baseline.float(), last, fusion_metrics(self.first, last, rounds)
