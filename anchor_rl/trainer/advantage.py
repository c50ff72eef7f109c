"""Stage 5: baselines and advantages, by name through ``anchor_rl.algos.registry``.

Shapes: B responses, T response tokens.

The estimator named by ``advantage.estimator`` is the baseline source (group mean,
leave-one-out, batch whitening, ...). The KL penalty enters here when ``kl.in_reward``:
as ``-coef * kl_t`` per token for token-level estimators (REINFORCE++), as
``-coef * sum_t kl_t`` on the sequence reward for the others (RLOO). A later baseline
source that needs a per-prompt value (the PVPO anchor, a V0.5 prior) passes it as
``anchor``; a critic passes ``values``.
"""

from __future__ import annotations

from torch import Tensor

from anchor_rl.algos.advantages import outcome_to_token_rewards
from anchor_rl.algos.losses import kl as kl_estimate
from anchor_rl.algos.registry import TOKEN_LEVEL, compute_advantage
from anchor_rl.trainer.config import TrainConfig

ZERO_TOL = 1e-6


def compute_advantages(
    cfg: TrainConfig,
    rewards: Tensor,
    index: Tensor,
    mask: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    anchor: Tensor | None = None,
) -> Tensor:
    """Token advantages ``[B, T]`` (0 where ``mask`` is 0).

    Args:
        rewards: FloatTensor[B], training rewards.
        index: LongTensor[B], group ids.
        mask: FloatTensor[B, T], the policy tokens that enter the loss.
        old_logp, ref_logp: FloatTensor[B, T] under the sampling and reference policies;
            ``ref_logp`` is needed only when ``kl.in_reward`` and ``kl.coef > 0``.
        anchor: FloatTensor[B], a per-prompt value for estimators that read one.
    """
    coef = cfg.kl.coef if cfg.kl.in_reward else 0.0
    token_level = cfg.advantage.estimator in TOKEN_LEVEL
    dense = None
    if coef > 0:
        if ref_logp is None:
            raise ValueError("kl.in_reward with kl.coef > 0 needs reference log-probs")
        kl_t = kl_estimate(old_logp, ref_logp, cfg.kl.kind) * mask
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
    if anchor is not None:
        inputs["anchor"] = anchor
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
