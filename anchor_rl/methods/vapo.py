"""VAPO's value side (arXiv 2504.05118), written once for every host: decoupled and
length-adaptive GAE and the critic's diagnostics.

Shapes: B responses, T response tokens; ``mask[B, T]`` marks the policy's tokens.

The native :class:`~anchor_rl.trainer.critic.PPOCritic` and the verl trainer's advantage
stage both compute::

    policy_lambda   the policy's lambda per response: a number, or 1 - 1/(alpha l)
    GAE             the advantages with that lambda (``anchor_rl.algos.gae``)
    critic_targets  the critic's returns with its own lambda (1.0: Monte-Carlo returns) and
                    the advantages whitened over the batch (``critic.whiten``)
    critic_metrics  explained variance, first-token error, advantages by length
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from anchor_rl.algos.advantages import masked_whiten
from anchor_rl.algos.gae import gae, length_adaptive_lambda
from anchor_rl.methods.critic_config import CriticConfig
from anchor_rl.models.value_metrics import advantage_stats_by_length, value_metrics


def policy_lambda(cc: CriticConfig, mask: Tensor) -> Tensor:
    """FloatTensor[B]: ``critic.policy_lam``, or VAPO's ``1 - 1/(alpha l)`` per response
    (``l = mask.sum(-1)``, clamped to ``[lam_min, 1 - 1e-6]``) when it is ``adaptive``."""
    if cc.policy_lam == "adaptive":
        return length_adaptive_lambda(mask.sum(-1), cc.lam_alpha, cc.lam_min)
    return torch.full((mask.shape[0],), float(cc.policy_lam))


def critic_returns(
    cc: CriticConfig,
    gamma: float,
    token_rewards: Tensor,
    values: Tensor,
    advantages: Tensor,
    mask: Tensor,
) -> Tensor:
    """The critic's regression targets ``[B, T]`` (decoupled GAE), 0 where ``mask`` is 0.

    ``critic.lam = "policy"``: the returns of the policy's GAE, ``advantages + values``;
    a number: GAE with that lambda and ``gamma`` on the same values and token rewards. For lambda = 1 the values cancel out of the returns (the
    discounted reward-to-go); leaving them out keeps those returns exact, so equal
    outcomes give equal returns (explained variance NaN, not float noise divided by float
    noise).

    Args:
        token_rewards, values, advantages (the policy's, before whitening), mask: ``[B, T]``.
    """
    lam = cc.lam
    if lam == "policy":
        return torch.where(mask > 0, advantages + values, 0)
    lam_critic = float(lam)
    bootstrap = values if lam_critic < 1 else torch.zeros_like(values)
    return gae(token_rewards, bootstrap, mask, gamma, lam_critic)[1]


def critic_targets(
    cc: CriticConfig, gamma: float, inputs: Mapping[str, Any], advantages: Tensor
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` ``[B, T]`` from the GAE estimator's advantages: the policy's
    (whitened over the batch's policy tokens when ``critic.whiten``, 0 where the mask is 0)
    and the critic's regression targets (:func:`critic_returns`).

    ``inputs`` are the step's estimator inputs (``mask``, ``token_rewards``, ``values``).
    """
    mask, values = inputs["mask"], inputs["values"]
    returns = critic_returns(cc, gamma, inputs["token_rewards"], values, advantages, mask)
    if cc.whiten:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


def critic_metrics(
    values: Tensor,
    returns: Tensor,
    advantages: Tensor,
    policy_lam: Tensor,
    mask: Tensor,
    rewards: Tensor,
) -> dict[str, float]:
    """Diagnostics of the values the step's advantages were built on (before the update).

    ``critic/value_mse``, ``critic/explained_variance`` (of the returns by the values, NaN
    when every return is equal), ``critic/first_token_error`` (mean ``|V(s_0) - r|``),
    ``critic/value_mean``, ``critic/return_mean``; ``critic/policy_lam`` (mean lambda of
    the responses' advantages); and ``advantage/len_q{0..3}/{n_seq,length,mean,std}``: the
    advantages by response-length quartile.
    """
    lengths = mask.sum(-1)
    nonempty = lengths > 0
    lam = policy_lam[nonempty].mean().item() if bool(nonempty.any()) else math.nan
    return {
        **value_metrics(values, returns, mask, rewards, prefix="critic"),
        "critic/policy_lam": lam,
        **advantage_stats_by_length(advantages, mask, prefix="advantage"),
    }
