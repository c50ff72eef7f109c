"""Outcome and token-level advantage estimators.

Shapes: ``B`` responses, ``T`` response tokens. ``rewards`` is a float tensor ``[B]`` of
outcome rewards; ``index`` is an integer tensor ``[B]`` of group ids (one group per prompt;
any integers, not necessarily contiguous or sorted); ``mask`` is a 0/1 float tensor
``[B, T]`` marking the policy's own tokens (0 for padding and for tool output inside a
multi-turn response).

Every estimator is a pure function; outputs are constants (they never carry gradient).

Estimators are registered by name with :func:`register_advantage`, which records the
keyword inputs each one reads; the trainer's ``advantage.estimator`` accepts exactly the
registered names, and a new estimator is one decorated function (docs/algorithms.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from anchor_rl.algos.gae import gae
from anchor_rl.registry import Registry

INPUTS = ("rewards", "index", "anchor", "baseline", "token_rewards", "dense_rewards", "mask",
          "gamma", "values", "lam", "vstar", "ref_log_ratio", "beta", "policy_value")  # fmt: skip
"""Every input name an estimator may read (what the trainer can supply):

``rewards[B]`` outcome rewards; ``index[B]`` group ids; ``anchor[B]`` PVPO's static anchor of
each response's prompt; ``baseline[B]`` V0.5's fused baseline of each response's prompt;
``token_rewards[B, T]`` per-token rewards with the outcome on the last policy token (and the
KL penalty when it is in the reward); ``dense_rewards[B, T]`` the per-token rewards besides
the outcome; ``mask[B, T]``; ``gamma`` the discount; ``values[B, T]`` a critic's V(s_t);
``lam`` GAE's lambda, a float or ``[B]``; ``vstar[B]`` A*-PO's optimal value of each
response's prompt; ``ref_log_ratio[B]`` the sampling policy's sequence log-ratio to the
reference, ``sum_t (log pi_old - log pi_ref)``; ``beta`` A*-PO's beta2; ``policy_value[B]`` the
perfect baseline, each prompt's expected reward under the current policy."""


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator.

    fn: the function; called with the keyword ``inputs`` it reads.
    inputs: the names of :data:`INPUTS` it reads, required ones first.
    token_level: whether it returns ``[B, T]`` (else ``[B]``, one value per response). The
        trainer folds an in-reward KL penalty into ``token_rewards`` for token-level
        estimators and into ``rewards`` (summed over tokens) for the others.
    """

    fn: Callable[..., Tensor]
    inputs: tuple[str, ...]
    token_level: bool = False


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
"""Registered estimators by name, in registration order."""


def register_advantage(
    name: str, *, inputs: tuple[str, ...], token_level: bool = False
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Register the decorated function as estimator ``name`` (returned unchanged).

    ``inputs`` names the keyword arguments it reads: names of :data:`INPUTS`, or a name a
    method component of the run supplies (``Component.advantage_inputs``). Registering a
    name twice is an error (a plug-in would silently replace a built-in otherwise).
    """
    if not inputs or len(set(inputs)) != len(inputs):
        raise ValueError(f"estimator {name!r} needs distinct input names, got {inputs}")

    def decorate(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        ESTIMATORS.add(name, Estimator(fn, tuple(inputs), token_level))
        return fn

    return decorate


def _check_outcome(rewards: Tensor, index: Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float tensor, got {rewards.dtype}")
    if index.shape != rewards.shape:
        raise ValueError(
            f"index must have the shape of rewards {tuple(rewards.shape)}, got {tuple(index.shape)}"
        )
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise ValueError(f"index must be an integer tensor of group ids, got {index.dtype}")


def _check_token(name: str, x: Tensor, mask: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(x.shape)}")
    if mask.shape != x.shape:
        raise ValueError(
            f"mask must have the shape of {name} {tuple(x.shape)}, got {tuple(mask.shape)}"
        )


def _group_centre(rewards: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(r - group mean)[B]``, the group of each row ``[B]`` and group sizes ``[G]``."""
    _, group, counts = torch.unique(index, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel(), dtype=rewards.dtype, device=rewards.device)
    sums.index_add_(0, group, rewards)
    mean = sums / counts.to(rewards.dtype)
    return rewards - mean[group], group, counts


@register_advantage("grpo", inputs=("rewards", "index"))
def grpo(rewards: Tensor, index: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-normalised advantage ``[B]``.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased (n - 1) standard deviation of
    the rewards in the group ``g`` of response ``i``; with ``scale_by_std=False`` (Dr. GRPO)
    ``A_i = r_i - mean_g``. A group of size 1 has advantage 0 (it has no baseline to
    compare against).
    """
    _check_outcome(rewards, index)
    centred, group, counts = _group_centre(rewards, index)
    if not scale_by_std:
        return centred
    sq = torch.zeros(counts.numel(), dtype=rewards.dtype, device=rewards.device)
    sq.index_add_(0, group, centred.square())
    # size-1 groups: sq = 0 and centred = 0, so the clamp only avoids 0/0.
    std = (sq / (counts - 1).clamp(min=1).to(rewards.dtype)).sqrt()
    return centred / (std[group] + eps)


@register_advantage("drgrpo", inputs=("rewards", "index"))
def drgrpo(rewards: Tensor, index: Tensor) -> Tensor:
    """Dr. GRPO advantage ``[B]``: ``A_i = r_i - mean_g`` (GRPO without the std scaling)."""
    return grpo(rewards, index, scale_by_std=False)


@register_advantage("rloo", inputs=("rewards", "index"))
def rloo(rewards: Tensor, index: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantage ``[B]``.

    ``A_i = r_i - mean of the other n - 1 rewards of the group = n/(n-1) * (r_i - mean_g)``.
    A group of size 1 has advantage 0.
    """
    _check_outcome(rewards, index)
    centred, group, counts = _group_centre(rewards, index)
    n = counts[group].to(rewards.dtype)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return centred * scale


@register_advantage("pvpo", inputs=("rewards", "anchor"))
def pvpo(rewards: Tensor, anchor: Tensor) -> Tensor:
    """PVPO static-anchor advantage ``[B]``: ``A_i = r_i - V_sta(prompt_i)``, no std scaling.

    ``anchor[B]`` holds, for each response, the anchor value of its prompt (the mean reward
    of the reference policy's presampled rollouts).
    """
    if rewards.dim() != 1 or anchor.shape != rewards.shape:
        raise ValueError(
            "rewards and anchor must both be 1-D [B] of the same shape, got "
            f"{tuple(rewards.shape)} and {tuple(anchor.shape)}"
        )
    return rewards - anchor.to(rewards.dtype)


@register_advantage("v05", inputs=("rewards", "baseline"))
def v05(rewards: Tensor, baseline: Tensor) -> Tensor:
    """V0.5 advantage ``[B]``: ``A_i = r_i - b(prompt_i)``, no std scaling.

    ``baseline[B]`` holds, for each response, its prompt's prior fused with the prompt's
    rollouts (:func:`anchor_rl.algos.v05.fuse`).
    """
    return pvpo(rewards, baseline)


def optimal_value(rewards: Tensor, beta: float) -> Tensor:
    """A*-PO's optimal value ``V*(x) = beta * log(mean_j exp(r_j / beta))`` of each row of
    ``rewards[..., N]`` (``N`` reference rewards of one prompt) -> ``[...]``.

    It is the value of the KL-regularised optimum ``pi* ~ pi_ref exp(r / beta)`` estimated
    from reference samples: the mean reward as ``beta -> inf``, the best reward as
    ``beta -> 0``, in between for any ``beta > 0`` (computed with logsumexp, stable for
    small ``beta``).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    n = rewards.shape[-1]
    if n == 0:
        raise ValueError("optimal_value needs at least one reward per prompt")
    x = rewards.double() / beta
    return (beta * (torch.logsumexp(x, dim=-1) - math.log(n))).to(rewards.dtype)


def optimal_value_binary(p: Tensor, beta: float) -> Tensor:
    """:func:`optimal_value` of rewards in {0, 1} from the fraction ``p[...]`` of ones:
    ``beta * log(1 - p + p exp(1 / beta))`` (what N rewards with a fraction ``p`` of ones give,
    exactly; no per-draw rewards needed)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    p = p.double()
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError("p must lie in [0, 1]")
    # log(1 - p + p e^(1/b)) = 1/b + log(p + (1 - p) e^(-1/b)); p = 0 gives 0 exactly
    inner = p + (1 - p) * math.exp(-1.0 / beta)
    out = torch.where(p > 0, 1.0 + beta * torch.log(inner.clamp(min=1e-300)), torch.zeros_like(p))
    return out


def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each outcome reward on its response's last policy token: ``[B] -> [B, T]``.

    The last policy token is the last position with ``mask > 0``; every other position is 0.
    A row with no policy token has no action to credit and gets an all-zero row.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"expected rewards [B] and mask [B, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}"
        )
    keep = mask > 0
    T = mask.shape[1]
    last = (T - 1) - keep.flip(-1).to(torch.int8).argmax(dim=-1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    value = torch.where(keep.any(dim=-1), rewards, torch.zeros_like(rewards))
    return out.scatter_(1, last.unsqueeze(1), value.unsqueeze(1))


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and unbiased variance over the entries
    where ``mask > 0`` (``[B, T]``, e.g. GAE advantages over a batch's policy tokens); 0
    elsewhere."""
    keep = mask > 0
    n = int(keep.sum())
    if n == 0:
        return torch.zeros_like(x)
    mean = x[keep].mean()
    var = x[keep].var() if n > 1 else x.new_zeros(())
    return torch.where(keep, (x - mean) * torch.rsqrt(var + eps), 0)


@register_advantage("reinforce_pp", inputs=("token_rewards", "mask", "gamma"), token_level=True)
def reinforce_pp(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantage ``[B, T]``: discounted token returns whitened over the batch.

    ``G_t = sum_{s >= t} gamma^(n(s) - n(t)) r_s`` over the policy tokens ``s`` of the same
    response (``n`` counts policy tokens, so tool output inside a response is skipped and
    rewards under ``mask == 0`` are ignored; see :func:`anchor_rl.algos.gae.gae`). The
    returns are then whitened, ``(G - mean) / sqrt(var + 1e-8)``, with the mean and unbiased
    variance over every policy token of the batch. 0 under ``mask == 0``.

    The caller folds the KL penalty into ``token_rewards`` (``-beta * kl`` per token) and
    puts the outcome reward on the last policy token (:func:`outcome_to_token_rewards`).
    """
    _check_token("token_rewards", token_rewards, mask)
    _, returns = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return masked_whiten(returns, mask)


@register_advantage(
    "reinforce_pp_baseline",
    inputs=("rewards", "index", "mask", "dense_rewards", "gamma"),
    token_level=True,
)
def reinforce_pp_baseline(
    rewards: Tensor,
    index: Tensor,
    mask: Tensor,
    dense_rewards: Tensor | None = None,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++ with a group baseline, ``[B, T]``.

    Subtract the group mean from the outcome rewards ``[B]``, place the centred reward on
    each response's last policy token, add the optional per-token ``dense_rewards[B, T]``
    (e.g. ``-beta * kl``), then proceed as :func:`reinforce_pp` (discounted returns,
    whitened over the batch). With no dense rewards and ``gamma = 1`` every policy token of
    response ``i`` gets the whitened value of ``r_i - mean_g``.
    """
    _check_outcome(rewards, index)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"mask must be [B, T] with B = {rewards.shape[0]}, got {tuple(mask.shape)}"
        )
    token_rewards = outcome_to_token_rewards(grpo(rewards, index, scale_by_std=False), mask)
    if dense_rewards is not None:
        _check_token("dense_rewards", dense_rewards, mask)
        token_rewards = token_rewards + dense_rewards.to(token_rewards.dtype)
    return reinforce_pp(token_rewards, mask, gamma)


@register_advantage(
    "gae", inputs=("token_rewards", "values", "mask", "gamma", "lam"), token_level=True
)
def gae_advantage(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float | Tensor = 1.0,
) -> Tensor:
    """GAE advantages ``[B, T]`` on a critic's ``values[B, T]`` (PPO, VAPO); ``lam`` a float or
    ``[B]`` (VAPO's length-adaptive lambda). See :func:`anchor_rl.algos.gae.gae`."""
    return gae(token_rewards, values, mask, gamma, lam)[0]


@register_advantage("astarpo", inputs=("rewards", "vstar", "ref_log_ratio", "beta"))
def astarpo(rewards: Tensor, vstar: Tensor, ref_log_ratio: Tensor, beta: float) -> Tensor:
    """A*-PO's regression target ``[B]`` relative to the sampling policy.

    ``A_i = r_i - V*(x_i) - beta * ref_log_ratio_i``: the optimal advantage estimate minus the
    implicit reward ``beta * log(pi_old / pi_ref)`` the sampling policy already has.
    The ``astarpo`` policy loss regresses ``beta * sum_t (log pi - log pi_old)`` on it, which
    is the paper's ``(beta * log(pi / pi_ref) - (r - V*))^2`` exactly
    (:func:`anchor_rl.algos.losses.astarpo_loss`).
    """
    if rewards.dim() != 1 or vstar.shape != rewards.shape or ref_log_ratio.shape != rewards.shape:
        raise ValueError(
            "rewards, vstar and ref_log_ratio must all be 1-D [B] of the same shape, got "
            f"{tuple(rewards.shape)}, {tuple(vstar.shape)} and {tuple(ref_log_ratio.shape)}"
        )
    return rewards - vstar.to(rewards.dtype) - beta * ref_log_ratio.to(rewards.dtype)


@register_advantage("perfect", inputs=("rewards", "policy_value"))
def perfect(rewards: Tensor, policy_value: Tensor) -> Tensor:
    """The perfect baseline's advantage ``[B]``: ``A_i = r_i - V^pi(prompt_i)``, no std.

    ``policy_value[B]`` holds, for each response, its prompt's expected reward under the
    current policy (estimated each step from many extra samples; a bound, not a method).
    """
    return pvpo(rewards, policy_value)
