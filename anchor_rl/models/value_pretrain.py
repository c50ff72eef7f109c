"""Value pretraining (VAPO): fit the critic to Monte-Carlo returns of a fixed policy.

A critic initialised from a language model starts far from the policy's values, and PPO's
GAE advantages built on it are biased for many steps (VAPO's ablation: AIME24 60 -> 11
without it). VAPO therefore first trains the critic alone, on rollouts of the *fixed*
reference policy, against Monte-Carlo targets (GAE with ``lambda = 1``, ``gamma = 1``): every
policy token's target is its response's final reward. Tool-output tokens and padding are
masked out of the loss (``batch.loss_mask``).

Shapes: ``B`` responses, ``T`` response tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from anchor_rl.algos.advantages import outcome_to_token_rewards
from anchor_rl.algos.gae import gae
from anchor_rl.algos.losses import value_loss
from anchor_rl.errors import NonFiniteError
from anchor_rl.models.critic import Critic
from anchor_rl.models.value_metrics import explained_variance, first_token_value_error
from anchor_rl.progress import Progress

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from anchor_rl.batch import RolloutBatch


class Shards(Protocol):
    """This process's place among data-parallel ranks (``cluster.data_parallel.DataParallel``)."""

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's rows of a mini-batch ``rows[M]``."""
        ...

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module this rank's passes call (one whose backward sums the gradients over
        the ranks, e.g. ``DistributedDataParallel``)."""
        ...

    def passes(
        self, module: torch.nn.Module, parts: Sequence[Tensor], lockstep: int = 1
    ) -> Iterator[Tensor | None]:
        """Each of ``parts`` to run through ``module`` in turn, then ``None`` for each
        zero-weighted pass the ranks' collectives need (``lockstep``: the passes sharded
        ranks make in all)."""
        ...

    def micro_batches(self, rows: int, micro_batch: int | None) -> int:
        """The passes the busiest rank makes on a mini-batch of ``rows`` rows."""
        ...

    def stopping(self, stop: bool) -> list[int]:
        """The ranks that vote to ``stop`` (this one's vote given): the same list on every rank
        (a collective)."""
        ...

    def sum_stats(self, stats: Mapping[str, float]) -> dict[str, float]:
        """The figures' sums over the ranks."""
        ...


SampleFn = Callable[[int], tuple["RolloutBatch", Tensor]]
"""``sample_fn(step) -> (batch, rewards[B])``: fresh rollouts of the fixed policy and their rewards."""

HISTORY_FILE = "history.json"
SETTINGS_FILE = "settings.json"


def mc_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Monte-Carlo returns ``[B, T]`` of outcome rewards ``rewards[B]`` (``lambda = 1``): on
    every token with ``mask > 0`` the reward discounted by ``gamma`` per policy token after
    it (``gamma = 1``: ``rewards[b]`` itself), 0 elsewhere.

    Equal, on masked tokens, to the returns of
    ``gae.gae(outcome_to_token_rewards(rewards, mask), values, mask, gamma, lam=1.0)`` for
    any ``values``: the critic's regression targets when ``critic.lam = 1``.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"expected rewards [B] and mask [B, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}"
        )
    if gamma != 1.0:
        token_rewards = outcome_to_token_rewards(rewards.to(mask.dtype), mask)
        return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)[1]
    return torch.where(
        mask > 0,
        rewards.to(mask.dtype)[:, None],
        torch.zeros((), dtype=mask.dtype, device=mask.device),
    )


def pretrain_value(
    critic: Critic,
    sample_fn: SampleFn,
    steps: int,
    lr: float,
    *,
    value_clip: float = 0.5,
    mini_batch: int | None = None,
    micro_batch: int | None = None,
    max_grad_norm: float | None = 1.0,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    ev_threshold: float | None = None,
    seed: int = 0,
    gamma: float = 1.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``critic`` on Monte-Carlo returns of a fixed policy (:func:`mc_returns`,
    discounted by ``gamma``), in place.

    Each step draws ``(batch, rewards) = sample_fn(step)`` (fresh rollouts, never reused),
    computes the critic's values on it without gradient (``old_values``), records the
    explained variance and first-token error of those values, and then -- unless it
    stops -- makes one pass over the batch in shuffled mini-batches of ``mini_batch``
    responses (None: the whole batch, one update), one AdamW update each, on the clipped
    value loss :func:`anchor_rl.algos.losses.value_loss` (token-mean over
    ``batch.loss_mask``, clip range ``value_clip`` around ``old_values``; the VAPO paper does
    not state one, 0.5 is verl's default).

    Early stop: with ``ev_threshold`` set, training stops as soon as a step's explained
    variance reaches it. That EV is measured on the step's fresh batch *before* the critic
    trains on it, so it is a held-out estimate. A NaN EV (all returns equal) never stops it.

    ``micro_batch`` bounds the rows per forward/backward (gradients are accumulated with
    token weights, so it does not change the update). AdamW state is local to this call.

    Returns the history: ``explained_variance``, ``first_token_error`` (one per sampled
    batch, pre-update) and ``loss``, ``vf_clipfrac`` (one per trained step, the token-
    weighted mean over its mini-batches); ``steps`` (batches trained on), ``updates``
    (optimiser steps) and ``stopped_early``. A run that stops early has one more EV entry
    than loss entries.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    for name, value in (("mini_batch", mini_batch), ("micro_batch", micro_batch)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    params = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    device = critic.device
    history: dict[str, Any] = {
        "loss": [],
        "vf_clipfrac": [],
        "explained_variance": [],
        "first_token_error": [],
        "steps": 0,
        "updates": 0,
        "stopped_early": False,
    }
    was_training = critic.training
    critic.train()
    try:
        with Progress("value pretraining", steps, enabled=progress) as bar:
            for step in range(steps):
                batch, rewards = sample_fn(step)
                if rewards.shape != (len(batch),):
                    raise ValueError(
                        f"sample_fn({step}) gave rewards of shape {tuple(rewards.shape)} for {len(batch)} responses"
                    )
                mask = batch.loss_mask.to(device, torch.float32)
                returns = mc_returns(rewards.to(device, torch.float32), mask, gamma)
                with torch.no_grad():
                    old_values = critic.values(batch, micro_batch)
                ev = explained_variance(old_values, returns, mask)
                history["explained_variance"].append(ev)
                history["first_token_error"].append(
                    first_token_value_error(old_values, rewards.to(device), mask)
                )
                if ev_threshold is not None and ev >= ev_threshold:
                    history["stopped_early"] = True
                    bar.update(info=f"EV {ev:.3f} >= {ev_threshold}: stop")
                    break
                b = len(batch)
                shuffle = mini_batch is not None and mini_batch < b
                order = torch.randperm(b, generator=generator) if shuffle else torch.arange(b)
                fit = fit_values(
                    critic, optimizer, batch, mask, old_values, returns,
                    torch.split(order, mini_batch or b), value_clip=value_clip,
                    micro_batch=micro_batch, max_grad_norm=max_grad_norm,
                )  # fmt: skip
                history["loss"].append(fit["loss"])
                history["vf_clipfrac"].append(fit["vf_clipfrac"])
                history["steps"] += 1
                history["updates"] += fit["updates"]
                bar.update(advance=1, info=f"EV {ev:.3f}  loss {fit['loss']:.4f}")
    finally:
        critic.train(was_training)
    return history


def fit_values(
    critic: Critic,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    mask: Tensor,
    old_values: Tensor,
    returns: Tensor,
    schedule: Iterable[Tensor],
    *,
    value_clip: float,
    micro_batch: int | None = None,
    max_grad_norm: float | None = None,
    dp: Shards | None = None,
) -> dict[str, float]:
    """One optimiser step of the clipped value loss per mini-batch of ``schedule``.

    ``schedule`` yields row indices (a mini-batch each; one with no masked token is
    skipped). Per token ``0.5 * max((V - R)^2, (V_clip - R)^2)``, ``V_clip`` = ``old_values``
    moved by at most ``value_clip``, token-mean over the mini-batch; micro-batches of
    ``micro_batch`` rows accumulate gradients weighted by their tokens, so they change
    memory, not the update. The gradient norm is clipped to ``max_grad_norm`` (None: not
    clipped, still measured). With ``dp`` (data-parallel ranks, every one calling this with
    the same arguments) each rank backpropagates its rows of each mini-batch, weighted by
    the whole mini-batch's tokens, and the gradients are summed before the step, so every
    rank takes the step one process would; the returned figures are the whole batch's.

    Args:
        mask, old_values, returns: ``[B, T]`` (any device; moved to the critic's).

    Returns ``loss`` and ``vf_clipfrac`` (token-weighted over every mini-batch, NaN when
    nothing was trained), ``grad_norm`` (mean over optimiser steps) and ``updates``.
    """
    device = critic.device
    params = [p for p in critic.parameters() if p.requires_grad]
    mask, old_values, returns = mask.to(device), old_values.to(device), returns.to(device)
    loss_sum = clip_sum = tokens_sum = norm_sum = 0.0
    updates = 0
    for rows in schedule:
        rows = rows.to(device)
        tokens = float(mask[rows].sum())
        if tokens == 0:
            continue
        optimizer.zero_grad(set_to_none=True)
        mine = rows if dp is None else dp.shard(rows)
        parts = list(torch.split(mine, micro_batch or len(mine))) if len(mine) else []
        passes: Iterable[Tensor | None] = parts
        forward: torch.nn.Module = critic
        if dp is not None:  # the gradients are summed over the ranks during the backward
            forward = dp.wrap(critic)
            passes = dp.passes(forward, parts, dp.micro_batches(len(rows), micro_batch))
        for part in passes:
            part_tokens = 0.0 if part is None else float(mask[part].sum())
            if part_tokens == 0:  # no token to fit, or no rows left
                if dp is not None:  # a zero-weighted pass: it joins the ranks' collectives
                    chosen = rows[:1] if part is None else part
                    (forward(batch.select(chosen.cpu())).sum() * 0.0).backward()
                continue
            loss, metrics = value_loss(
                forward(batch.select(part.cpu())), old_values[part], returns[part],
                mask[part], clip=value_clip,
            )  # fmt: skip
            (loss * (part_tokens / tokens)).backward()
            loss_sum += float(loss.detach()) * part_tokens
            clip_sum += float(metrics["vf_clipfrac"]) * part_tokens
            tokens_sum += part_tokens
        limit = math.inf if max_grad_norm is None else max_grad_norm
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        bad, where = not (math.isfinite(norm) and math.isfinite(loss_sum)), ""
        if dp is not None:  # the loss sum is this rank's rows': every rank stops when any
            # would, else one stopping alone leaves the others waiting in the next all-reduce
            ranks = dp.stopping(bad)
            bad, where = bool(ranks), f" on learner rank {', '.join(map(str, ranks))}"
        if bad:
            raise NonFiniteError(
                f"the value update: a NaN or infinite loss or gradient norm{where} (here: loss "
                f"sum = {loss_sum}, grad_norm = {norm}); the step was not taken"
            )
        norm_sum += norm
        optimizer.step()
        updates += 1
    optimizer.zero_grad(set_to_none=True)
    if dp is not None:
        sums = dp.sum_stats({"loss": loss_sum, "clip": clip_sum, "tokens": tokens_sum})
        loss_sum, clip_sum, tokens_sum = sums["loss"], sums["clip"], sums["tokens"]
    if updates == 0:
        return {"loss": math.nan, "vf_clipfrac": math.nan, "grad_norm": math.nan, "updates": 0}
    return {
        "loss": loss_sum / tokens_sum,
        "vf_clipfrac": clip_sum / tokens_sum,
        "grad_norm": norm_sum / updates,
        "updates": updates,
    }


def cache_key(key_dict: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """16-hex-digit SHA-256 of ``key_dict`` and the pretraining ``settings`` (sorted JSON)."""
    try:
        blob = json.dumps({"key": key_dict, "settings": settings}, sort_keys=True)
    except TypeError as err:
        raise TypeError(
            f"key_dict must be JSON-serialisable (str, numbers, bools, None, lists, dicts): {err}"
        ) from err
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def pretrain_value_cached(
    cache_dir: str | os.PathLike,
    key_dict: Mapping[str, Any],
    build_critic: Callable[[], Critic],
    sample_fn: SampleFn,
    steps: int,
    lr: float,
    *,
    policy: PreTrainedModel | None = None,
    device: str | torch.device | None = None,
    value_clip: float = 0.5,
    mini_batch: int | None = None,
    micro_batch: int | None = None,
    max_grad_norm: float | None = 1.0,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    ev_threshold: float | None = None,
    seed: int = 0,
    gamma: float = 1.0,
    progress: bool = True,
) -> tuple[Critic, dict[str, Any]]:
    """:func:`pretrain_value` with its result cached on disk: ``(critic, history)``.

    The cache entry is ``cache_dir/value-<hash>`` with the hash of ``key_dict`` and every
    setting that changes the result (``steps``, ``lr`` and the keywords but ``policy``,
    ``micro_batch``, ``device`` and ``progress``).
    ``key_dict`` must identify everything else the result
    depends on: the reference policy checkpoint, the critic's initialisation and mode, the
    task and prompts, sampling parameters and seeds. On a hit nothing is built, sampled or
    trained: the critic is read with ``Critic.load(entry, policy=policy, device=device)``
    (``policy`` is needed for a shared critic). On a miss ``build_critic()`` makes a fresh
    critic (on the device it chooses), it is pretrained and then saved, with
    ``settings.json`` and ``history.json``, into a temporary directory renamed into place
    (a concurrent writer's entry wins). ``history["from_cache"]`` says which happened.
    """
    settings = {
        "steps": steps,
        "lr": lr,
        "value_clip": value_clip,
        "mini_batch": mini_batch,
        "max_grad_norm": max_grad_norm,
        "weight_decay": weight_decay,
        "betas": list(betas),
        "ev_threshold": ev_threshold,
        "seed": seed,
        "gamma": gamma,
    }
    digest = cache_key(key_dict, settings)
    root = Path(cache_dir)
    entry = root / f"value-{digest}"
    if (entry / HISTORY_FILE).is_file():
        critic = Critic.load(entry, policy=policy, device=device)
        history = json.loads((entry / HISTORY_FILE).read_text())
        return critic, {**history, "from_cache": True}

    critic = build_critic()
    history = pretrain_value(
        critic, sample_fn, **(settings | {"betas": betas}), micro_batch=micro_batch,
        progress=progress,
    )  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".value-{digest}-"))
    try:
        critic.save(tmp)
        (tmp / SETTINGS_FILE).write_text(
            json.dumps({"key": key_dict, "settings": settings}, indent=2, sort_keys=True) + "\n"
        )
        (tmp / HISTORY_FILE).write_text(json.dumps(history, indent=2) + "\n")
        tmp.rename(entry)
    except OSError:
        if not (entry / HISTORY_FILE).is_file():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return critic, {**history, "from_cache": False}
