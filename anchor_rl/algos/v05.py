"""V0.5: fuse a sparse empirical baseline with a prior, and size the rollout budget.

Shapes: ``P`` prompts. ``emp_mean[P]`` is the mean reward of the ``k[P]`` rollouts made so
far, ``prior[P]`` the prior's value ``V`` of each prompt, ``sigma2`` the per-rollout reward
variance (a float or a tensor ``[P]``; 1 for +-1 rewards in the paper).

With ``d = emp_mean - prior`` and the empirical mean's noise ``s = sigma2 / k``:

* fusion (positive-part James-Stein toward the prior)::

      w = max(0, 1 - s / d^2)        (w = 0 when d = 0)
      b = V + w * d

  The prior is *rejected* when ``d^2 > s`` (then ``w > 0``); otherwise ``b = V``.
* the estimated MSE of ``b``: the prior's squared bias is estimated as
  ``D2 = max(0, d^2 - s)``; the fused estimator with the optimal weight
  ``w* = D2 / (D2 + s)`` (which equals ``w`` above) has ``MSE(k) = D2 * s / (D2 + s)``.
* the budget: add a rollout while ``MSE(n) - MSE(n + 1) > cost`` (``D2`` held at its
  current estimate), up to ``k_max`` rollouts in all.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _prepare(
    emp_mean: Tensor, k: Tensor, prior: Tensor, sigma2: float | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate and return ``(d, noise = sigma2 / k, sigma2)`` as float tensors ``[P]``."""
    if emp_mean.dim() != 1:
        raise ValueError(f"emp_mean must be 1-D [P], got shape {tuple(emp_mean.shape)}")
    if k.shape != emp_mean.shape or prior.shape != emp_mean.shape:
        raise ValueError(
            "emp_mean, k and prior must share one shape [P], got "
            f"{tuple(emp_mean.shape)}, {tuple(k.shape)}, {tuple(prior.shape)}"
        )
    dtype = emp_mean.dtype if emp_mean.is_floating_point() else torch.get_default_dtype()
    s2 = torch.as_tensor(sigma2, dtype=dtype, device=emp_mean.device)
    if s2.dim() > 0 and s2.shape != emp_mean.shape:
        raise ValueError(f"sigma2 must be a float or a tensor [P], got shape {tuple(s2.shape)}")
    s2 = s2.expand(emp_mean.shape)
    if bool((s2 < 0).any()):
        raise ValueError("sigma2 must be >= 0")
    if bool((k < 1).any()):
        raise ValueError("k must be >= 1 (at least one rollout per prompt)")
    d = emp_mean.to(dtype) - prior.to(dtype)
    return d, s2 / k.to(dtype), s2


def fuse(
    emp_mean: Tensor, k: Tensor, prior: Tensor, sigma2: float | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Shrink the empirical mean toward the prior (positive-part James-Stein).

    Returns:
        ``(baseline[P], weight[P], rejected[P])``: ``baseline = V + weight * (emp_mean - V)``,
        ``weight = max(0, 1 - (sigma2/k) / (emp_mean - V)^2)`` (the weight on the empirical
        mean; 0 when ``emp_mean == V``), ``rejected = (emp_mean - V)^2 > sigma2/k`` (bool).
        The baseline stays within ``sigma/sqrt(k)`` of ``emp_mean``.
    """
    d, noise, _ = _prepare(emp_mean, k, prior, sigma2)
    d2 = d.square()
    rejected = d2 > noise
    safe_d2 = torch.where(rejected, d2, torch.ones_like(d2))
    weight = torch.where(rejected, 1.0 - noise / safe_d2, torch.zeros_like(d2))
    baseline = prior.to(d.dtype) + weight * d
    return baseline, weight, rejected


def estimated_mse(emp_mean: Tensor, k: Tensor, prior: Tensor, sigma2: float | Tensor) -> Tensor:
    """Estimated MSE ``[P]`` of the fused baseline after ``k`` rollouts.

    ``MSE(k) = D2 * (sigma2/k) / (D2 + sigma2/k)`` with the prior's squared bias estimated as
    ``D2 = max(0, (emp_mean - V)^2 - sigma2/k)``. It is 0 for an accepted prior (``D2 = 0``:
    no evidence the prior is biased) and approaches ``sigma2/k`` (the empirical mean's
    variance) as the prior's disagreement grows.
    """
    d, noise, _ = _prepare(emp_mean, k, prior, sigma2)
    bias2 = (d.square() - noise).clamp(min=0)
    return _mse(bias2, noise)


def _mse(bias2: Tensor, noise: Tensor) -> Tensor:
    total = bias2 + noise
    return torch.where(total > 0, bias2 * noise / torch.where(total > 0, total, 1.0), 0.0)


def extra_rollouts(
    emp_mean: Tensor,
    k: Tensor,
    prior: Tensor,
    sigma2: float | Tensor,
    cost: float,
    k_max: int,
) -> Tensor:
    """How many MORE rollouts to sample per prompt, ``[P]`` (int64), by one-step look-ahead.

    Starting from ``n = k``, one more rollout is added while
    ``MSE(n) - MSE(n + 1) > cost`` and ``n < k_max``, with ``MSE(n) = D2 * (sigma2/n) /
    (D2 + sigma2/n)`` and ``D2 = max(0, (emp_mean - V)^2 - sigma2/k)`` estimated once from
    the current ``k`` rollouts (see :func:`estimated_mse`). The gain
    ``MSE(n) - MSE(n+1) = D2^2 sigma2 / ((n D2 + sigma2)((n+1) D2 + sigma2))`` falls with
    ``n`` and rises with ``D2``, so the result is 0 for an accepted prior (``D2 = 0``), at
    most ``max(0, k_max - k)``, and non-decreasing in ``|emp_mean - V|``. (Paper: ``cost = 0.0039`` for +-1 rewards,
    ``k_max = 16``; for a strongly rejected prior this grows ``k = 4`` up to 16.)
    """
    if cost < 0:
        raise ValueError(f"cost must be >= 0, got {cost}")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    d, noise, s2 = _prepare(emp_mean, k, prior, sigma2)
    bias2 = (d.square() - noise).clamp(min=0)
    # gain(n) = s2 / ((n + u)(n + 1 + u)) with u = s2 / D2: the same value as the formula
    # above, written so that rounding keeps it monotone in D2 (and 0 when D2 = 0).
    has_bias = bias2 > 0
    u = s2 / torch.where(has_bias, bias2, torch.ones_like(bias2))
    k_long = k.to(torch.long)
    extra = torch.zeros_like(k_long)
    going = torch.ones_like(has_bias)
    for j in range(max(0, k_max - int(k_long.min()))):
        n = k_long + j
        n_f = n.to(d.dtype)
        gain = torch.where(has_bias, s2 / ((n_f + u) * (n_f + 1 + u)), torch.zeros_like(u))
        going = going & (n < k_max) & (gain > cost)
        extra += going.to(torch.long)
    return extra
