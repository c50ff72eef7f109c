"""Policy, value, NLL and KL losses, and loss aggregation.

Shapes: ``B`` responses, ``T`` response tokens, ``V`` vocabulary. ``logp`` is the current
policy's log-probability of each sampled token ``[B, T]``; ``mask`` is 0/1 float ``[B, T]``
(1 for the policy's own tokens). Values under ``mask == 0`` never reach a loss, even if
they are inf or NaN.

Policy losses are registered by name with :func:`register_policy_loss` (``loss.policy_loss``
in the trainer's config); ``ppo`` is :func:`policy_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from anchor_rl.registry import Registry

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, clip_c, agg, norm_const)
-> (loss, metrics)``: tensors ``[B, T]`` (advantages ``[B]`` or ``[B, T]``), the loss a 0-d
tensor with gradient, metrics detached 0-d tensors (logged as ``policy/NAME``). A loss that
has no use for a setting accepts it and ignores it."""

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
"""Registered policy losses by name."""


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register the decorated function as policy loss ``name`` (returned unchanged)."""
    return POLICY_LOSSES.register(name)


def check_bt(mask: Tensor, **tensors: Tensor) -> None:
    """ValueError unless ``mask`` is 2-D ``[B, T]`` and every named tensor has its shape."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x.shape != mask.shape:
            raise ValueError(
                f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(x.shape)}"
            )


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` with exact zeros (no NaN) wherever ``mask == 0``."""
    return torch.where(mask > 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the masked entries; 0 when the mask is empty."""
    return _masked(x.to(mask.dtype), mask).sum() / mask.sum().clamp(min=1)


def kl(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and a reference, same shape as ``logp``.

    With ``x = clamp(logp - ref_logp, -20, 20)`` (tokens sampled from the policy):

    * ``k1 = x`` (unbiased, high variance, can be negative),
    * ``k2 = x^2 / 2`` (low bias for nearby policies),
    * ``k3 = exp(-x) + x - 1`` (unbiased for KL(policy || ref), always >= 0), clamped to
      ``[-10, 10]``.

    Aggregate with :func:`agg`. Clamping stops the gradient outside the clamp range.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must share one shape, got {tuple(logp.shape)} and {tuple(ref_logp.shape)}"
        )
    x = (logp - ref_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x.square()
    if kind == "k3":
        # expm1(-x) + x rather than exp(-x) + x - 1: the latter rounds to small negative
        # values for |x| ~ 1e-12, the former stays >= 0 (expm1(-x) >= -x, both rounded
        # monotonically) and keeps k3's x^2/2 precision near 0.
        return (torch.expm1(-x) + x).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def agg(values: Tensor, mask: Tensor, mode: str, norm_const: float | None = None) -> Tensor:
    """Aggregate per-token ``values[B, T]`` into a scalar loss.

    * ``token-mean``: ``sum_{i,t} m v / sum_{i,t} m`` (every token weighs the same; DAPO).
    * ``seq-mean-token-mean``: mean over sequences of ``sum_t m v / sum_t m`` (GRPO).
    * ``seq-mean-token-sum``: mean over sequences of ``sum_t m v``.
    * ``seq-mean-token-sum-norm``: mean over sequences of ``sum_t m v / C`` with the constant
      ``C = norm_const`` (default: the padded length ``T``) (Dr. GRPO).

    Sequence means run over the sequences with at least one masked token, so an all-zero
    row neither contributes nor dilutes; an all-zero mask gives 0 (never NaN).
    """
    check_bt(mask, values=values)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    masked = _masked(values, mask)
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1)
    token_sum = masked.sum(dim=-1)
    tokens = mask.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = token_sum / tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = token_sum
    else:
        const = float(mask.shape[-1] if norm_const is None else norm_const)
        if const <= 0:
            raise ValueError(f"norm_const must be > 0, got {norm_const}")
        per_seq = token_sum / const
    present = (tokens > 0).to(per_seq.dtype)
    return (per_seq * present).sum() / present.sum().clamp(min=1)


_agg = agg  # policy_loss and value_loss shadow the name with their `agg` argument


@register_policy_loss("ppo")
def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    agg: str = "token-mean",
    norm_const: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss (PPO with clip-higher and optional dual clip).

    With ``ratio = exp(clamp(logp - old_logp, -20, 20))`` and advantage ``A``::

        l = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
        l = min(l, -A * clip_c)      for A < 0, when clip_c is given (dual clip)

    aggregated with ``agg`` (see :func:`agg`; ``norm_const`` is passed on).

    ``old_logp`` is the behaviour policy's log-probability of each token and is treated as
    a constant (detached here). Nothing assumes it came from the policy: rows holding an
    injected teacher trajectory carry the teacher's cached log-probs, and their ratio is
    ``pi_theta / pi_teacher`` (PVPO's ``pi_gt``).

    Args:
        logp, old_logp, mask: ``[B, T]``.
        advantages: ``[B]`` (one per response, broadcast over tokens) or ``[B, T]``.
        clip_low, clip_high: clip range ``[1 - clip_low, 1 + clip_high]``.
        clip_c: dual-clip bound (> 1) on the loss of negative-advantage tokens, or None.

    Returns:
        ``(loss, metrics)`` with detached 0-d tensors in ``metrics``:
        ``clipfrac_low`` / ``clipfrac_high`` (fraction of masked tokens where the lower
        clip binds, ``A < 0`` and ``ratio < 1 - clip_low``, or the upper clip binds,
        ``A > 0`` and ``ratio > 1 + clip_high``), ``clipfrac_dual`` (``A < 0`` and
        ``ratio > clip_c``; 0 without dual clip), ``approx_kl`` (``mean (logp - old)^2 / 2``,
        the k2 estimate of the KL to the behaviour policy) and ``ratio_mean``.
    """
    check_bt(mask, logp=logp, old_logp=old_logp)
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        adv = advantages.unsqueeze(-1)
    elif advantages.shape == mask.shape:
        adv = advantages
    else:
        raise ValueError(
            f"advantages must be [B] or [B, T] with [B, T] = {tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")

    adv = adv.detach()
    log_ratio = (logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    negative = adv < 0
    if clip_c is not None:
        per_token = torch.where(negative, torch.minimum(per_token, -adv * clip_c), per_token)
    loss = _agg(per_token, mask, agg, norm_const)

    with torch.no_grad():
        positive = adv > 0
        metrics = {
            "clipfrac_low": _masked_mean((negative & (ratio < 1.0 - clip_low)).float(), mask),
            "clipfrac_high": _masked_mean((positive & (ratio > 1.0 + clip_high)).float(), mask),
            "clipfrac_dual": _masked_mean(
                (negative & (ratio > clip_c)).float()
                if clip_c is not None
                else torch.zeros_like(ratio),
                mask,
            ),
            "approx_kl": _masked_mean(0.5 * log_ratio.square(), mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return loss, metrics


@register_policy_loss("astarpo")
def astarpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "seq-mean-token-sum",
    norm_const: float | None = None,
    beta: float = 1e-3,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A*-PO's least-squares regression (arXiv 2505.20686), one value per response.

    With ``D_i = sum_t m (logp - old_logp)`` (the sequence log-ratio to the sampling policy)
    and ``A_i`` the ``astarpo`` estimator's target (``r_i - V*(x_i) - beta * sum_t m (log
    pi_old - log pi_ref)``, read off the response's policy tokens)::

        loss = mean_i (beta * D_i - A_i)^2
             = mean_i (beta * log(pi(y_i|x_i) / pi_ref(y_i|x_i)) - (r_i - V*(x_i)))^2

    averaged over the responses with at least one policy token. No ratio clipping: the
    regression keeps the policy near the reference through ``beta``; ``clip_*``, ``agg``
    and ``norm_const`` are accepted and ignored (the trainer weighs micro-batches by their
    responses, so ``loss.agg`` must be a sequence mean).

    Args:
        logp, old_logp, mask: ``[B, T]``; advantages: ``[B]`` or ``[B, T]`` (the target on
            every policy token of its response).
        beta: A*-PO's beta2 (> 0).

    Returns ``(loss, metrics)``: ``regression_mse`` (the loss), ``log_ratio_mean`` (mean of
    ``D_i``, detached) and ``target_mean`` (mean ``A_i``).
    """
    check_bt(mask, logp=logp, old_logp=old_logp)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    tokens = mask.sum(-1)
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        target = advantages
    elif advantages.shape == mask.shape:
        target = _masked(advantages, mask).sum(-1) / tokens.clamp(min=1)
    else:
        raise ValueError(
            f"advantages must be [B] or [B, T] with [B, T] = {tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    target = target.detach().to(logp.dtype)
    log_ratio = _masked(logp - old_logp.detach(), mask).sum(-1)
    present = (tokens > 0).to(logp.dtype)
    err = (beta * log_ratio - target).square()
    loss = (err * present).sum() / present.sum().clamp(min=1)
    with torch.no_grad():
        count = present.sum().clamp(min=1)
        metrics = {
            "regression_mse": loss.detach(),
            "log_ratio_mean": (log_ratio * present).sum() / count,
            "target_mean": (target * present).sum() / count,
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float,
    agg: str = "token-mean",
    norm_const: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``[B, T] -> scalar`` (PPO style).

    ``v_clip = old + clamp(values - old, -clip, clip)`` and per token
    ``0.5 * max((values - R)^2, (v_clip - R)^2)``, aggregated with ``agg``. ``old_values``
    and ``returns`` are constants (detached). Metrics (detached 0-d tensors):
    ``vf_clipfrac`` (fraction of masked tokens where the clipped error is the larger) and
    ``vf_mse`` (masked mean of ``(values - R)^2``).
    """
    check_bt(mask, values=values, old_values=old_values, returns=returns)
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    old_values, returns = old_values.detach(), returns.detach()
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    err = (values - returns).square()
    err_clip = (v_clip - returns).square()
    loss = _agg(0.5 * torch.maximum(err, err_clip), mask, agg, norm_const)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": _masked_mean((err_clip > err).float(), mask),
            "vf_mse": _masked_mean(err, mask),
        }
    return loss, metrics


def nll(logp: Tensor, mask: Tensor, select: Tensor) -> Tensor:
    """Token-mean negative log-likelihood over the selected sequences (VAPO's positive-example
    loss): ``-sum_{i: select_i, t} m logp / sum_{i: select_i, t} m``; 0 if nothing is selected.

    ``select[B]`` is 0/1 (or bool), e.g. ``reward == max reward``.
    """
    check_bt(mask, logp=logp)
    if select.shape != mask.shape[:1]:
        raise ValueError(f"select must be [B] = ({mask.shape[0]},), got {tuple(select.shape)}")
    weight = mask * select.to(mask.dtype).unsqueeze(-1)
    return -_masked(logp, weight).sum() / weight.sum().clamp(min=1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``[B, T]`` of the softmax over the last axis of ``logits[B, T, V]``.

    ``H = logsumexp(z) - sum softmax(z) * z``, computed in float32 for half-precision input
    (float64 stays float64). ``-inf`` logits (banned tokens) are allowed and contribute 0.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(z, dim=-1)
    finite_z = torch.where(torch.isneginf(z), torch.zeros((), dtype=z.dtype, device=z.device), z)
    return torch.logsumexp(z, dim=-1) - (probs * finite_z).sum(dim=-1)
