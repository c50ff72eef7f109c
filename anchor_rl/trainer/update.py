"""Stages 4 and 6 of a step: log-probs under the old and reference policies, and the update.

Shapes: B responses, T response tokens.

The update runs ``optim.epochs`` passes over the batch, each split into
``optim.mini_batches`` mini-batches (one optimizer step each), each processed in
micro-batches of ``optim.micro_batch_size`` responses with gradient accumulation. Each
micro-batch's loss is weighted by its share of the mini-batch (tokens for token means,
non-empty responses for sequence means), so the accumulated gradient equals the gradient
of the whole mini-batch's loss whatever the micro-batch size.

The loss is a sum of named terms (:func:`loss_terms`): the clipped policy loss, the KL
to the reference when it is in the loss, an NLL term on correct responses. A critic adds
its value loss there.

``optim.autocast = "bf16"`` runs the policy's and the reference's forward passes (the
re-scoring, the reference's scoring and the update's) under ``torch.autocast`` with
bfloat16 (:func:`forward_precision`): the matmuls run in bf16, while the weights, their
gradients, the optimiser state and the log-softmax stay float32. The re-scoring and the
update use the same precision, so the first mini-batch's ratio is 1 up to the bf16
forward's dependence on which rows share it (about 2e-2 at most; exactly 1 in the
single-pass update, whose denominator is its own forward).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from anchor_rl.algos.losses import agg, kl, nll
from anchor_rl.algos.registry import get_policy_loss
from anchor_rl.batch import RolloutBatch, minibatches
from anchor_rl.cluster.data_parallel import DataParallel
from anchor_rl.errors import NonFiniteError
from anchor_rl.methods.peers_config import policy_loss_options
from anchor_rl.models.scoring import ScoringForward, token_logprobs
from anchor_rl.trainer.config import TrainConfig


@torch.no_grad()
def score_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, cfg: TrainConfig, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``(logp[B, T], entropy[B, T] | None)`` of the batch under ``model``, no gradient, on
    the CPU with the rest of the batch.

    The model is scored in eval mode, as the engine samples: these are the log-probs of the
    distribution the tokens were drawn from. Logits are divided by the rollout temperature,
    as in the update's forward pass, so with dropout off (``disable_dropout``) the first
    mini-batch's ratio is exactly 1 for the recomputed old log-probs.
    """
    was_training = model.training
    model.eval()
    try:
        with forward_precision(model, cfg):
            logp, entropy = token_logprobs(
                model,
                batch,
                with_entropy=with_entropy,
                micro_batch=cfg.optim.micro_batch_size,
                temperature=cfg.rollout.temperature,
                **layout(cfg),
            )
    finally:
        model.train(was_training)
    return logp.cpu(), None if entropy is None else entropy.cpu()


def forward_precision(model: torch.nn.Module, cfg: TrainConfig) -> AbstractContextManager:
    """The context of a scoring or update forward pass of ``model``: ``torch.autocast`` to
    bfloat16 on the model's device for ``optim.autocast = "bf16"``, else nothing."""
    if cfg.optim.autocast == "off":
        return nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def layout(cfg: TrainConfig, sharded: bool = False) -> dict[str, bool | None]:
    """``token_logprobs``'s ``packed`` and ``shared`` for ``optim.padding_free`` and
    ``optim.shared_prefix`` (None: where supported); ``sharded`` (FSDP learners): padded."""
    if sharded or cfg.optim.padding_free == "off":
        return {"packed": False, "shared": False}
    on = {"auto": None, "on": True, "off": False}
    return {"packed": on[cfg.optim.padding_free], "shared": on[cfg.optim.shared_prefix]}


def behaviour_logprobs(old_logp: Tensor, batch: RolloutBatch, off_policy: Tensor) -> Tensor:
    """``old_logp[B, T]`` with the rows ``off_policy`` (BoolTensor[B]) taken from ``batch.logprobs``.

    Responses another policy wrote (PVPO's teacher trajectories, whose ``logprobs`` are
    log pi_gt) keep that policy's log-probs, so their importance ratio is pi_theta / pi_gt
    instead of one recomputed under the current policy.
    """
    return torch.where(off_policy.unsqueeze(-1), batch.logprobs, old_logp)


def token_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of ``values[B, T]`` over the tokens where ``mask`` is 1 (0 for an empty mask)."""
    return ((values * mask).sum() / mask.sum().clamp(min=1)).item()


def loss_mask(batch: RolloutBatch, cfg: TrainConfig) -> Tensor:
    """FloatTensor[B, T]: the policy's tokens, minus truncated responses when ``loss.mask_truncated``."""
    mask = batch.loss_mask
    if cfg.loss.mask_truncated:
        mask = mask * (~batch.truncated).to(mask.dtype).unsqueeze(-1)
    return mask


def loss_weights(mask: Tensor, correct: Tensor, cfg: TrainConfig) -> dict[str, tuple[Tensor, str]]:
    """Per loss term, the mask and aggregation mode that define its denominator.

    A micro-batch's term is weighted by its count over the mini-batch's count (tokens
    for ``token-mean``, non-empty responses for the sequence means), which makes the
    accumulated loss equal to the mini-batch's. Every term of :func:`loss_terms` has an
    entry here.
    """
    weights = {"policy": (mask, cfg.loss.agg)}
    if cfg.kl.coef > 0 and not cfg.kl.in_reward:
        weights["kl"] = (mask, cfg.loss.agg)
    if cfg.loss.nll_coef > 0:
        weights["nll"] = (mask * correct.to(mask.dtype).unsqueeze(-1), "token-mean")
    return weights


def loss_terms(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    mask: Tensor,
    correct: Tensor,
    cfg: TrainConfig,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The loss terms of one (micro-)batch, each multiplied by its coefficient, and the
    policy-loss metrics. Tensors are ``[b, T]`` except ``correct`` (BoolTensor[b]).

    Terms: ``policy`` (the registered ``loss.policy_loss``, the clipped surrogate by default), ``kl`` (coef * KL to the reference, when the KL
    is in the loss), ``nll`` (VAPO's NLL on correct responses, when ``loss.nll_coef > 0``).
    """
    lc = cfg.loss
    norm = float(cfg.rollout.max_new_tokens)  # Dr. GRPO's constant: the generation budget
    pg, metrics = get_policy_loss(lc.policy_loss)(
        logp, old_logp, adv, mask, clip_low=lc.clip_low, clip_high=lc.clip_high,
        clip_c=lc.clip_c, agg=lc.agg, norm_const=norm, **policy_loss_options(cfg),
    )  # fmt: skip
    terms = {"policy": pg}
    if cfg.kl.coef > 0 and not cfg.kl.in_reward:
        if ref_logp is None:
            raise ValueError("a KL loss needs reference log-probs")
        terms["kl"] = cfg.kl.coef * agg(kl(logp, ref_logp, cfg.kl.kind), mask, lc.agg, norm)
    if lc.nll_coef > 0:
        terms["nll"] = lc.nll_coef * nll(logp, mask, correct)
    return terms, metrics


FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose AdamW runs fused (one kernel over all parameters) in :func:`adamw`."""


def adamw(params: Iterable[torch.nn.Parameter], **options: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **options)``, fused where every parameter is a plain
    floating-point tensor on the CPU or a CUDA device (``fused=True``; what TRL's trainer
    uses too, its default ``optim="adamw_torch_fused"``); else PyTorch's default (foreach).
    Fused, a step takes about a quarter of the time on one CPU thread (``tiny``'s 1.1M
    parameters 2.2 ms instead of 8.0, ``small``'s 10.5M 19 ms instead of 86, Intel Xeon,
    ``benchmarks/probe_adamw.py``). The same update up to floating-point rounding (weights
    7.5e-9 apart after ten steps); parameters sharded as DTensors (FSDP) keep the default."""
    params = list(params)
    fused = bool(params) and all(
        type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in FUSED_DEVICES
        for p in params
    )
    return torch.optim.AdamW(params, fused=fused or None, **options)


def make_optimizer(
    cfg: TrainConfig, params: Iterable[torch.nn.Parameter]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The policy's AdamW (``optim.lr``, ``betas``, ``weight_decay``) and its schedule: a linear
    warm-up over ``optim.warmup_steps`` optimiser steps, then constant."""
    oc = cfg.optim
    optimizer = adamw(params, lr=oc.lr, betas=oc.betas, weight_decay=oc.weight_decay)
    warmup = oc.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    mask: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    correct: Tensor,
    cfg: TrainConfig,
    generator: torch.Generator | None,
    *,
    schedule: Iterable[Tensor] | None = None,
    dp: DataParallel | None = None,
    seen: dict[str, Tensor] | None = None,
) -> dict[str, float]:
    """Epochs of clipped policy-gradient steps on one batch; returns averaged metrics.

    Args:
        batch: B responses; mask, old_logp, ref_logp, adv: ``[B, T]``; correct: BoolTensor[B].
        old_logp: None for the single pass (``optim.rescore``): one optimiser step on the
            whole batch, whose own forward supplies the ratio's denominator (detached, so
            the ratio is 1, as with log-probs recomputed under the same weights); ``seen``
            then receives that forward's ``logp`` and ``entropy`` (``[B, T]``, detached).
        generator: shuffles the responses into mini-batches when there are several
            (``schedule``, the mini-batches' row indices, replaces it when given).
        dp: this process's rank among data-parallel learners (``cluster.data_parallel``):
            it backpropagates its share of every mini-batch, with the mini-batch's own loss
            normalisers, and the gradients are summed over the ranks before the step, so
            every rank takes the step one process would take on the whole mini-batch.
    """
    oc = cfg.optim
    if schedule is None:
        assert generator is not None
        schedule = minibatches(len(batch), oc.epochs, oc.mini_batches, generator)
    if old_logp is None:
        schedule = list(schedule)
        if len(schedule) != 1 or len(schedule[0]) != len(batch) or dp is not None:
            raise ValueError("the single pass (old_logp=None) takes one step on the whole batch")
    model.train()
    sums: dict[str, float] = defaultdict(float)
    steps = 0
    for rows in schedule:
        if len(rows) == 0:
            continue
        stats = _accumulate(
            model, batch, rows, mask, old_logp, ref_logp, adv, correct, cfg, dp, seen
        )
        if dp is not None:  # the gradients were summed during the backward passes
            stats = dp.sum_stats(stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        check_finite("the policy update", stats | {"grad_norm": grad_norm.item()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        for key, value in stats.items():
            sums[key] += value
        sums["grad_norm"] += grad_norm.item()
        steps += 1
    metrics = {key: value / steps for key, value in sums.items()}
    metrics["lr"] = scheduler.get_last_lr()[0]
    return metrics


def check_finite(stage: str, values: dict[str, float]) -> None:
    """NonFiniteError naming ``stage`` and the first NaN or infinite value of ``values``
    (call it before the optimiser step, so the weights stay as they were)."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        shown = ", ".join(f"{k} = {v}" for k, v in list(bad.items())[:3])
        raise NonFiniteError(f"{stage}: {shown}")


def _accumulate(
    model: torch.nn.Module,
    batch: RolloutBatch,
    rows: Tensor,
    mask: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    adv: Tensor,
    correct: Tensor,
    cfg: TrainConfig,
    dp: DataParallel | None = None,
    seen: dict[str, Tensor] | None = None,
) -> dict[str, float]:
    """Backpropagate the mini-batch ``rows`` (this rank's share of it, with ``dp``) in
    micro-batches; returns its metrics (this rank's share of each sum). ``old_logp`` None:
    the forward's own log-probs, detached (:func:`ppo_update`), stored in ``seen``."""
    device = next(model.parameters()).device
    totals = {
        name: _count(w, mode)
        for name, (w, mode) in loss_weights(mask[rows], correct[rows], cfg).items()
    }
    tokens = mask[rows].sum().clamp(min=1)
    stats: dict[str, float] = defaultdict(float)
    mine = rows if dp is None else dp.shard(rows)
    parts = list(torch.split(mine, cfg.optim.micro_batch_size or len(mine))) if len(mine) else []
    forward = None if dp is None else dp.wrap(model, ScoringForward)
    passes: Iterable[Tensor | None] = parts
    shape = layout(cfg)
    if dp is not None:  # DDP: one synchronising pass; FSDP: every rank the same passes
        lockstep = dp.micro_batches(len(rows), cfg.optim.micro_batch_size)
        passes = dp.passes(forward, parts, lockstep)
        shape = layout(cfg, sharded=dp.sharded)  # FSDP scores padded
    single = old_logp is None
    own: list[tuple[Tensor, Tensor]] = []
    for part in passes:
        if part is None:  # a pass for the collectives only: no rows of this mini-batch left
            _zero_weight_pass(model, forward, batch.select(rows[:1]), cfg)
            continue
        m, c = mask[part].to(device), correct[part].to(device)
        ref = None if ref_logp is None else ref_logp[part].to(device)
        with forward_precision(model, cfg):  # the backward runs outside autocast
            logp, entropy = token_logprobs(
                model,
                batch.select(part),
                with_entropy=single,
                temperature=cfg.rollout.temperature,
                forward=forward,
                **shape,
            )
        if single:
            assert entropy is not None
            own.append((logp.detach(), entropy.detach()))
        old = own[-1][0] if single else old_logp[part].to(device)
        terms, pg_metrics = loss_terms(logp, old, ref, adv[part].to(device), m, c, cfg)
        total = torch.zeros((), device=device)
        for name, (w, mode) in loss_weights(m, c, cfg).items():
            weighted = terms[name] * (_count(w, mode) / max(totals[name], 1.0))
            total = total + weighted
            stats[f"loss/{name}"] += weighted.item()
        total.backward()
        stats["loss/total"] += total.item()
        share = (m.sum() / tokens).item()
        for key, value in pg_metrics.items():
            stats[f"policy/{key}"] += share * value.item()
    if single and seen is not None:  # back in batch order (the schedule may shuffle rows)
        for key, i in (("logp", 0), ("entropy", 1)):
            seen[key] = torch.zeros(mask.shape)
            seen[key][mine] = torch.cat([pair[i] for pair in own]).cpu()
    return stats


def _zero_weight_pass(
    model: torch.nn.Module, forward: torch.nn.Module | None, row: RolloutBatch, cfg: TrainConfig
) -> None:
    """A forward and backward pass of ``row`` through ``forward`` whose loss is weighted 0:
    the collectives of a mini-batch this rank has no (more) rows of (its gradients gain
    nothing)."""
    with forward_precision(model, cfg):
        logp, _ = token_logprobs(
            model, row, temperature=cfg.rollout.temperature, packed=False, forward=forward
        )
    (logp.sum() * 0.0).backward()


def _count(weight: Tensor, mode: str) -> float:
    """Tokens (``token-mean``) or non-empty responses (sequence means) under ``weight[b, T]``."""
    if mode == "token-mean":
        return weight.sum().item()
    return (weight.sum(-1) > 0).sum().item()
