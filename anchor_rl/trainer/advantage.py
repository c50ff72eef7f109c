"""Stage 5: baselines and advantages, by name through ``anchor_rl.algos.registry``.

Shapes: B responses, T response tokens.

The estimator named by ``advantage.estimator`` is the baseline source (group mean,
leave-one-out, batch whitening, a static anchor, a fused prior, a critic's values...). It
is called with the inputs it declares (:data:`anchor_rl.algos.advantages.INPUTS`): the loop
supplies rewards, group ids, the mask, token rewards and the discount
(:func:`base_inputs`); the run's components supply the rest (``anchor``, ``baseline``,
``values``, ``lam``). The KL penalty enters here when ``kl.in_reward``: as
``-coef * kl_t`` per token for token-level estimators (REINFORCE++, GAE), as
``-coef * sum_t kl_t`` on the sequence reward for the others (RLOO).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from anchor_rl.algos.advantages import outcome_to_token_rewards
from anchor_rl.algos.losses import kl as kl_estimate
from anchor_rl.algos.registry import compute_advantage, get_estimator
from anchor_rl.trainer.config import TrainConfig

ZERO_TOL = 1e-6


def base_inputs(
    cfg: TrainConfig,
    rewards: Tensor,
    index: Tensor,
    mask: Tensor,
    logp: Tensor | None,
    ref_logp: Tensor | None,
) -> dict[str, Any]:
    """The estimator inputs the loop supplies, with the in-reward KL penalty folded in.

    Args:
        rewards: FloatTensor[B], training rewards.
        index: LongTensor[B], group ids.
        mask: FloatTensor[B, T], the policy tokens that enter the loss.
        logp, ref_logp: FloatTensor[B, T] under the sampling and reference policies;
            needed only when ``kl.in_reward`` and ``kl.coef > 0`` (else they may be None).

    Returns ``rewards``, ``index``, ``mask``, ``token_rewards`` (the outcome on the last
    policy token, plus ``dense_rewards`` when present), ``gamma`` and, with an in-reward
    KL on a token-level estimator, ``dense_rewards = -coef * kl_t``.
    """
    coef = cfg.kl.coef if cfg.kl.in_reward else 0.0
    token_level = get_estimator(cfg.advantage.estimator).token_level
    dense = None
    if coef > 0:
        if ref_logp is None or logp is None:
            raise ValueError("kl.in_reward with kl.coef > 0 needs policy and reference log-probs")
        kl_t = kl_estimate(logp, ref_logp, cfg.kl.kind) * mask
        if token_level:
            dense = -coef * kl_t
        else:
            rewards = rewards - coef * kl_t.sum(-1)
    token_rewards = outcome_to_token_rewards(rewards, mask)
    if dense is not None:
        token_rewards = token_rewards + dense
    inputs = {
        "rewards": rewards,
        "index": index,
        "mask": mask,
        "token_rewards": token_rewards,
        "gamma": cfg.advantage.gamma,
    }
    if dense is not None:
        inputs["dense_rewards"] = dense
    return inputs


def compute_advantages(cfg: TrainConfig, inputs: Mapping[str, Any]) -> Tensor:
    """Token advantages ``[B, T]`` (0 where ``inputs["mask"]`` is 0) of the configured
    estimator; a missing input it requires raises TypeError naming it."""
    mask = inputs["mask"]
    adv = compute_advantage(cfg.advantage.estimator, **inputs)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(mask)
    return adv * mask


def advantage_metrics(adv: Tensor, mask: Tensor) -> dict[str, float]:
    """Per-response advantage (token mean) statistics over the batch, and the fraction of
    responses whose advantage is 0 on every token (they carry no policy gradient)."""
    tokens = mask.sum(-1)
    per_response = adv.sum(-1) / tokens.clamp(min=1)
    zero = (adv.abs() * mask).amax(-1) <= ZERO_TOL
    return {
        "advantage/mean": per_response.mean().item(),
        "advantage/std": per_response.std().item() if len(per_response) > 1 else 0.0,
        "advantage/zero_frac": zero.float().mean().item(),
    }
