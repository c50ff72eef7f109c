"""What verl 0.9.1's registries can carry, registered there: two advantage estimators and a
policy loss, each computing with :mod:`anchor_rl.algos`.

``compute_advantage`` (verl/trainer/ppo/ray_trainer.py) calls a registered estimator with
``token_level_rewards[B, T]``, ``response_mask[B, T]``, ``config`` (``algorithm``),
``index`` (the ``uid`` of each row) and, when the batch has it, ``reward_baselines[B]``. The
last is the one per-row input a trainer can fill: the ``anchor_rl`` trainer puts PVPO's
static anchor or V0.5's fused baseline there. With verl's own trainers, which never set it
for these estimators, they refuse to run.

A registered policy loss gets ``old_log_prob``, ``log_prob``, ``advantages``,
``response_mask`` ``[B, T]``, ``loss_agg_mode``, the actor ``config`` and
``rollout_is_weights``: enough for anchor-rl's clipped surrogate, not for VAPO's NLL on
correct responses (no reward reaches it; see :mod:`.losses`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss

from anchor_rl.algos.advantages import pvpo, v05
from anchor_rl.algos.losses import AGG_MODES
from anchor_rl.algos.losses import policy_loss as anchor_policy_loss
from anchor_rl.integrations.verl import ESTIMATORS, POLICY_LOSSES, TRAINER

__all__ = ["ppo_policy_loss", "pvpo_advantage", "rescale", "v05_advantage"]


def _baseline_advantage(
    name: str, token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor | None
) -> tuple[Tensor, Tensor]:
    if reward_baselines is None:
        raise ValueError(
            f"algorithm.adv_estimator={ESTIMATORS[name]} needs the per-prompt baseline in "
            f"reward_baselines[B], which only the {TRAINER} trainer supplies: set "
            f"trainer.v1.trainer_mode={TRAINER} and anchor_rl.method={name}"
        )
    rewards = token_level_rewards.sum(dim=-1)
    baselines = reward_baselines.to(rewards.dtype).reshape(rewards.shape)
    per_row = {"pvpo": pvpo, "v05": v05}[name](rewards, baselines)
    advantages = per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)
    return advantages, advantages


@register_adv_est(ESTIMATORS["pvpo"])
def pvpo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    config: Any = None,
    index: Any = None,
    reward_baselines: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """PVPO's ``A_i = r_i - V_sta(prompt_i)`` on every response token: ``(advantages,
    returns)``, both ``[B, T]``.

    ``r_i`` is the row's outcome, ``token_level_rewards[B, T]`` summed over the response;
    ``reward_baselines[B]`` the static anchor of its prompt
    (:func:`anchor_rl.algos.advantages.pvpo`). No std scaling.
    """
    return _baseline_advantage("pvpo", token_level_rewards, response_mask, reward_baselines)


@register_adv_est(ESTIMATORS["v05"])
def v05_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    config: Any = None,
    index: Any = None,
    reward_baselines: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """V0.5's ``A_i = r_i - b(prompt_i)``, ``b`` the prompt's prior fused with its rollouts
    (``reward_baselines[B]``, :func:`anchor_rl.algos.advantages.v05`): ``(advantages,
    returns)``, both ``[B, T]``."""
    return _baseline_advantage("v05", token_level_rewards, response_mask, reward_baselines)


def _info(config: Any) -> dict[str, Any]:
    info = getattr(config, "global_batch_info", None) or {}
    return dict(info)


def rescale(
    loss: Tensor,
    mask: Tensor,
    loss_agg_mode: str,
    info: dict[str, Any],
    tokens: Tensor | None = None,
) -> Tensor:
    """Turn a loss that anchor-rl normalised over this micro-batch (``agg`` over ``mask[B,
    T]``) into verl's normalisation over the global batch (``agg_loss`` with
    ``global_batch_info``: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``).

    ``token-mean``: ``loss * n / batch_num_tokens * dp_size`` with ``n`` the micro-batch's
    tokens (``tokens``, default ``mask.sum()``); the sequence means: ``loss * s /
    global_batch_size * dp_size`` with ``s`` its non-empty rows. Without global counts (one
    process, no accumulation) the loss is returned unchanged.
    """
    dp = int(info.get("dp_size") or 1)
    if loss_agg_mode == "token-mean":
        total = info.get("batch_num_tokens")
        local = mask.sum() if tokens is None else tokens
    else:
        total = info.get("global_batch_size")
        local = (mask.sum(dim=-1) > 0).sum()
    if total is None:
        if dp > 1:
            raise ValueError(f"verl's global batch counts are required when dp_size = {dp} > 1")
        return loss
    return loss * local.to(loss.dtype) / float(total) * dp


@register_policy_loss(POLICY_LOSSES[0])
def ppo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """anchor-rl's clipped surrogate (:func:`anchor_rl.algos.losses.policy_loss`) as verl's
    ``loss_mode=anchor_rl_ppo``: ``(loss, metrics)``, tensors ``[B, T]``.

    Clip range ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (each defaulting to
    ``clip_ratio``); the dual clip at ``clip_ratio_c`` for negative advantages, or none when
    ``clip_ratio_c`` is null (verl's ``vanilla`` always applies it; the PVPO, V0.5 and VAPO
    papers do not). Aggregated with ``loss_agg_mode`` and brought to verl's global
    normaliser by :func:`rescale`, so it equals ``vanilla`` when the dual clip is on.
    """
    if config is None:
        raise ValueError("anchor_rl_ppo needs the actor config (clip ratios, global batch info)")
    if rollout_is_weights is not None:
        raise ValueError(
            "anchor_rl_ppo does not apply rollout-correction weights: drop "
            "algorithm.rollout_correction or use policy_loss.loss_mode=vanilla"
        )
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(
            f"anchor_rl_ppo aggregates with {', '.join(AGG_MODES)}, got {loss_agg_mode!r}"
        )
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    clip_c = getattr(config, "clip_ratio_c", None)
    info = _info(config)
    mask = response_mask.to(log_prob.dtype)
    loss, metrics = anchor_policy_loss(
        log_prob, old_log_prob, advantages, mask, clip_low=float(low), clip_high=float(high),
        clip_c=None if clip_c is None else float(clip_c), agg=loss_agg_mode,
        norm_const=info.get("loss_scale_factor"),
    )  # fmt: skip
    loss = rescale(loss, mask, loss_agg_mode, info)
    return loss, {f"actor/anchor_rl/{k}": float(v) for k, v in metrics.items()}


def registered() -> dict[str, Any]:
    """Our names in verl's registries (for checks): estimator and policy-loss functions."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    names = [ESTIMATORS["pvpo"], ESTIMATORS["v05"]]
    out = {n: ADV_ESTIMATOR_REGISTRY.get(n) for n in names}
    out |= {n: POLICY_LOSS_REGISTRY.get(n) for n in POLICY_LOSSES}
    return out
