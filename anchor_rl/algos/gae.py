"""Generalised advantage estimation over the policy's own tokens.

Shapes: ``B`` responses, ``T`` response tokens; ``mask`` is 0/1 float ``[B, T]``.

Masking rule. Only tokens with ``mask > 0`` (the policy's actions) take part. Tokens under
``mask == 0`` -- right padding, and tool output inside a multi-turn response -- are
skipped: the TD chain runs over the policy tokens as if the masked ones were not there.
For a policy token ``t`` let ``t'`` be the next policy token of the same response; then

    delta_t = r_t + gamma * V(t') - V(t)          (V(t') = 0 after the last policy token)
    A_t     = delta_t + gamma * lam * A(t')       (A(t') = 0 after the last policy token)
    R_t     = A_t + V(t)

Rewards and values placed under ``mask == 0`` are ignored; put outcome rewards on the last
policy token (:func:`anchor_rl.algos.advantages.outcome_to_token_rewards`). Outputs are 0
under ``mask == 0``. The episode ends after the last policy token (no bootstrap), which
is the RLVR convention: a truncated response is scored as it stands.
"""

from __future__ import annotations

import torch
from torch import Tensor

LAMBDA_MAX = 1.0 - 1e-6
"""Upper clamp of :func:`length_adaptive_lambda` (see its docstring)."""


def _lambda_rows(lam: float | Tensor, B: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(lam, Tensor):
        if lam.shape != (B,):
            raise ValueError(f"lam tensor must have shape [B] = ({B},), got {tuple(lam.shape)}")
        if bool(((lam < 0) | (lam > 1)).any()):
            raise ValueError("lam must lie in [0, 1]")
        return lam.to(dtype=dtype, device=device)
    lam = float(lam)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")
    return torch.full((B,), lam, dtype=dtype, device=device)


@torch.no_grad()
def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns, both ``[B, T]``, skipping tokens under ``mask == 0``.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (outcome on the last policy token, plus
            any dense terms such as ``-beta * kl``).
        values: ``[B, T]`` critic values ``V(t)`` of each token's state.
        mask: ``[B, T]`` 1 for policy tokens, 0 for padding and tool output.
        gamma: discount in ``[0, 1]``, applied per policy token.
        lam: GAE lambda in ``[0, 1]``: a float, or a tensor ``[B]`` (one per response,
            e.g. :func:`length_adaptive_lambda`).

    Returns:
        ``(advantages, returns)``; constants (computed without gradient), 0 under
        ``mask == 0``. ``returns`` are the critic's regression targets.
    """
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D [B, T], got {tuple(token_rewards.shape)}")
    if values.shape != token_rewards.shape or mask.shape != token_rewards.shape:
        raise ValueError(
            "token_rewards, values and mask must share one shape [B, T], got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    rewards, values = token_rewards.to(dtype), values.to(dtype)
    B, T = rewards.shape
    discount = gamma * _lambda_rows(lam, B, dtype, rewards.device)
    keep = mask > 0

    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(T - 1, -1, -1):
        k = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + discount * next_adv
        advantages[:, t] = torch.where(k, adv_t, 0)
        next_adv = torch.where(k, adv_t, next_adv)
        next_value = torch.where(k, values[:, t], next_value)
    returns = torch.where(keep, advantages + values, 0)
    return advantages, returns


def length_adaptive_lambda(lengths: Tensor, alpha: float, lam_min: float = 0.0) -> Tensor:
    """VAPO's length-adaptive policy lambda ``[B]``: ``lam = 1 - 1 / (alpha * l)``.

    ``lengths[B]`` are the responses' policy-token counts (``mask.sum(-1)``). The result is
    clamped to ``[lam_min, LAMBDA_MAX]``:

    * lower: for ``alpha * l <= 1`` (short responses; ``l = 0`` gives ``-inf``) the formula is
      not a valid lambda, so it becomes ``lam_min``;
    * upper, ``LAMBDA_MAX = 1 - 1e-6``: the formula is below 1 for every finite length, and
      the clamp keeps it so after rounding (in float32, ``1 - 1/(alpha l)`` rounds to exactly
      1 once ``alpha * l`` exceeds about 3.4e7). The policy's GAE therefore always discounts,
      which is what separates it from the critic's ``lam = 1`` Monte-Carlo target in
      decoupled GAE. The clamp never changes a realistic value: reaching it needs
      ``alpha * l = 1e6``, i.e. 2e7 tokens at ``alpha = 0.05``.

    Computed in float64, returned in the default float dtype.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not 0.0 <= lam_min < LAMBDA_MAX:
        raise ValueError(f"lam_min must lie in [0, {LAMBDA_MAX}), got {lam_min}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0")
    lam = 1.0 - 1.0 / (alpha * lengths.to(torch.float64))
    return lam.clamp(lam_min, LAMBDA_MAX).to(torch.get_default_dtype())
