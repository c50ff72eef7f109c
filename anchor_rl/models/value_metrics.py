"""Critic and advantage diagnostics the trainer logs: pure functions, floats out.

Shapes: ``B`` responses, ``T`` response tokens; masks are 0/1 float ``[B, T]`` and select
the tokens that count (the policy's own tokens, ``loss_mask``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from anchor_rl.algos.losses import check_bt


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over the tokens with ``mask > 0`` (population variances).

    1 is a perfect critic, 0 is no better than predicting the mean return, negative is
    worse than that. NaN when ``Var[R] = 0`` (every masked return equal, or no masked
    token): the ratio is undefined, and NaN never passes a ``>=`` threshold.
    """
    check_bt(mask, values=values, returns=returns)
    keep = mask > 0
    ret = returns.detach()[keep].double()
    if ret.numel() == 0:
        return math.nan
    var_ret = ret.var(unbiased=False)
    if var_ret == 0:
        return math.nan
    resid = ret - values.detach()[keep].double()
    return float(1.0 - resid.var(unbiased=False) / var_ret)


def first_token_value_error(values: Tensor, rewards: Tensor, mask: Tensor) -> float:
    """Mean ``|V(s_0) - r|`` over responses: how well the critic predicts a prompt's reward
    before the policy has written anything (``values[:, 0]``, the state = the prompt).

    Rows whose first response token is masked out (empty responses) are skipped; NaN when
    no row is left.
    """
    check_bt(mask, values=values)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must be [B] = ({mask.shape[0]},), got {tuple(rewards.shape)}")
    keep = mask[:, 0] > 0
    if not bool(keep.any()):
        return math.nan
    err = values.detach()[keep, 0].double() - rewards.detach().to(keep.device)[keep].double()
    return float(err.abs().mean())


def value_metrics(
    values: Tensor, returns: Tensor, mask: Tensor, rewards: Tensor, prefix: str = "critic"
) -> dict[str, float]:
    """Flat dict of critic diagnostics for one batch (keys ``{prefix}/...``).

    ``value_mse``: masked token mean of ``(V - R)^2`` (the unclipped value error; the
    clipped training loss comes from :func:`anchor_rl.algos.losses.value_loss`);
    ``explained_variance`` (:func:`explained_variance`); ``first_token_error``
    (:func:`first_token_value_error` against the outcome ``rewards[B]``); ``value_mean``
    and ``return_mean`` (masked token means).
    """
    check_bt(mask, values=values, returns=returns)
    keep = mask > 0
    v, r = values.detach()[keep].double(), returns.detach()[keep].double()
    n = v.numel()
    return {
        f"{prefix}/value_mse": float((v - r).square().mean()) if n else math.nan,
        f"{prefix}/explained_variance": explained_variance(values, returns, mask),
        f"{prefix}/first_token_error": first_token_value_error(values, rewards, mask),
        f"{prefix}/value_mean": float(v.mean()) if n else math.nan,
        f"{prefix}/return_mean": float(r.mean()) if n else math.nan,
    }


def advantage_stats_by_length(
    advantages: Tensor,
    mask: Tensor,
    edges: Sequence[int] | None = None,
    n_buckets: int = 4,
    prefix: str = "adv",
) -> dict[str, float]:
    """Token-level mean and std of advantages, grouped by response length ``mask.sum(-1)``.

    Shows whether long and short responses get different credit (the bias VAPO's
    length-adaptive lambda targets). Two ways to bucket:

    * ``edges=None``: length quantiles. Responses are sorted by length (stable, ties in
      row order) and split into ``n_buckets`` groups of near-equal size; keys
      ``{prefix}/len_q{i}/...`` with ``i = 0`` the shortest.
    * ``edges=[e_1, ..., e_k]`` (positive, strictly increasing): fixed buckets ``[0, e_1)``,
      ``[e_1, e_2)``, ..., ``[e_k, inf)``; keys ``{prefix}/len_{lo}_{hi}/...`` with ``hi`` the
      exclusive bound or ``inf``.

    Empty responses (no masked token) are left out of every bucket.

    Per bucket: ``n_seq`` (responses in it) and, when it is not empty, ``length`` (their
    mean length), ``mean`` and ``std`` (population) of the advantages over its masked
    tokens. ``advantages`` is ``[B, T]`` or ``[B]`` (one per response, counted once
    per token).
    """
    check_bt(mask)
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        advantages = advantages[:, None].expand(mask.shape)
    check_bt(mask, advantages=advantages)
    adv = advantages.detach().double()
    keep = mask > 0
    lengths = keep.sum(-1)
    rows = torch.nonzero(lengths > 0).flatten()
    if edges is None:
        if n_buckets < 1:
            raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
        order = rows[torch.argsort(lengths[rows], stable=True)]
        groups = [(f"len_q{i}", g) for i, g in enumerate(torch.tensor_split(order, n_buckets))]
    else:
        bounds = [int(e) for e in edges]
        if any(b <= a for a, b in zip([0, *bounds], bounds, strict=False)):
            raise ValueError(f"edges must be positive and strictly increasing, got {list(edges)}")
        groups = []
        for lo, hi in zip([0, *bounds], [*bounds, math.inf], strict=True):
            name = f"len_{lo}_{'inf' if hi == math.inf else hi}"
            groups.append((name, rows[(lengths[rows] >= lo) & (lengths[rows] < hi)]))
    out: dict[str, float] = {}
    for name, members in groups:
        key = f"{prefix}/{name}"
        out[f"{key}/n_seq"] = float(members.numel())
        if members.numel() == 0:
            continue
        tokens = adv[members][keep[members]]
        out[f"{key}/length"] = float(lengths[members].double().mean())
        out[f"{key}/mean"] = float(tokens.mean())
        out[f"{key}/std"] = float(tokens.std(unbiased=False))
    return out
