"""Stages 1-3 of a step: rollout, rewards, filter.

Shapes: P prompts per round, n responses per prompt, G groups kept, B = G * n responses,
T response tokens.

``collect`` draws prompts from the stream, samples ``n`` responses each, scores them and
applies the group filter. Response ``j`` of the prompt drawn ``d``-th from the stream is
seeded by ``(seed, "train", d, j)`` (:func:`train_requests`), whatever else is sampled
with it. Without a filter that is one round. With dynamic sampling (DAPO) the groups whose
responses are all correct or all wrong (``filter.metric=correct``; ``reward``: whose shaped
rewards are all equal) carry no signal under a group baseline, so they are dropped and
further rounds are sampled until ``prompts_per_step`` groups are kept or
``filter.max_rounds`` rounds have run; surplus kept groups of the last round are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from anchor_rl.batch import RolloutBatch
from anchor_rl.rewards.overlong import soft_punishment
from anchor_rl.rollout.engine import Engine, Request, group_requests
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task
from anchor_rl.tools.base import Tool
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.timing import Timer


@dataclass
class Scored:
    """Scored responses. ``batch.group[i]`` indexes ``records`` (group ids 0..G-1).

    draws: the stream position each group's prompt was drawn at (seeds its rollouts; see
        :func:`train_requests`), one per record; None for rows that were not drawn.
    rewards: FloatTensor[B], the training reward (task reward plus shaping).
    task_rewards: FloatTensor[B], the task's reward alone.
    correct: BoolTensor[B], the task's verdict.
    off_policy: BoolTensor[B], responses another policy wrote (PVPO teacher trajectories):
        their old log-probs are ``batch.logprobs``, not recomputed. None: all False.
    """

    batch: RolloutBatch
    records: list[Record]
    rewards: Tensor
    task_rewards: Tensor
    correct: Tensor
    off_policy: Tensor | None = None
    draws: list[int] | None = None

    def __post_init__(self) -> None:
        if self.off_policy is None:
            self.off_policy = torch.zeros(len(self.batch), dtype=torch.bool)
        if self.draws is not None and len(self.draws) != len(self.records):
            raise ValueError(f"{len(self.draws)} draws for {len(self.records)} records")

    def __len__(self) -> int:
        return len(self.batch)

    def select_groups(self, keep: Tensor) -> Scored:
        """The groups with ``keep[g]`` true (BoolTensor[G]), renumbered 0..G'-1 in order."""
        new_id = torch.cumsum(keep.long(), 0) - 1
        rows = keep[self.batch.group]
        batch = self.batch.select(rows)
        batch.group = new_id[batch.group]
        kept = keep.tolist()
        return Scored(
            batch=batch,
            records=[r for r, k in zip(self.records, kept, strict=True) if k],
            rewards=self.rewards[rows],
            task_rewards=self.task_rewards[rows],
            correct=self.correct[rows],
            off_policy=self.off_policy[rows],
            draws=None
            if self.draws is None
            else [d for d, k in zip(self.draws, kept, strict=True) if k],
        )

    @staticmethod
    def cat(parts: Sequence[Scored]) -> Scored:
        """Concatenate, offsetting each part's group ids past the previous parts' groups."""
        batches, offset = [], 0
        for part in parts:
            batch = part.batch.select(range(len(part.batch)))
            batch.group = batch.group + offset
            batches.append(batch)
            offset += len(part.records)
        return Scored(
            batch=RolloutBatch.cat(batches),
            records=[r for p in parts for r in p.records],
            rewards=torch.cat([p.rewards for p in parts]),
            task_rewards=torch.cat([p.task_rewards for p in parts]),
            correct=torch.cat([p.correct for p in parts]),
            off_policy=torch.cat([p.off_policy for p in parts]),
            draws=None
            if any(p.draws is None for p in parts)
            else [d for p in parts for d in p.draws],
        )


def sampling_params(cfg: TrainConfig, task: Task) -> SamplingParams:
    """Training-rollout sampling parameters."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        stop=list(task.stop),
    )


def train_requests(
    records: Sequence[Record],
    draws: Sequence[int],
    n: int,
    seed: int,
    first: Sequence[int] | int = 0,
    stream: str = "train",
) -> list[Request]:
    """``n`` requests for each record, group i for ``records[i]``; sample ``j`` of the prompt
    drawn at stream position ``draws[i]`` is seeded by ``(seed, stream, draws[i], first_i + j)``
    (a top-up continues from ``first``)."""
    return group_requests([r.prompt for r in records], draws, n, seed, stream, first=first)


def rollout_call(
    task: Task,
    records: Sequence[Record],
    draws: Sequence[int],
    cfg: TrainConfig,
    stream: str = "train",
) -> tuple[list[Request], SamplingParams, dict[str, Tool] | None, str]:
    """The arguments of ``engine.rollout`` for :func:`generate` (also what an asynchronous
    run prefetches)."""
    requests = train_requests(records, draws, cfg.rollout.n, cfg.seed, stream=stream)
    return requests, sampling_params(cfg, task), task.tools or None, task.instruction


def generate(
    engine: Engine,
    task: Task,
    records: Sequence[Record],
    draws: Sequence[int],
    cfg: TrainConfig,
    stream: str = "train",
) -> RolloutBatch:
    """``rollout.n`` responses for each record (drawn at ``draws``); group i belongs to
    ``records[i]``."""
    return engine.rollout(*rollout_call(task, records, draws, cfg, stream))


def prefetch_next(
    engine: Any, sampler: PromptSampler, task: Task, cfg: TrainConfig, steps: int = 1
) -> None:
    """Have the first rollout call of each of the next ``steps`` steps sent on ``engine`` (a
    ``PrefetchingEngine``): step ``j``'s ``prompts_per_step`` prompts of the stream, without
    consuming them. Calls already pending stay; pending ones the stream has moved past are
    discarded."""
    want = cfg.rollout.prompts_per_step
    first = sampler.consumed
    records = sampler.peek(want * steps)
    calls = [
        rollout_call(
            task,
            records[j * want : (j + 1) * want],
            range(first + j * want, first + (j + 1) * want),
            cfg,
        )
        for j in range(steps)
    ]
    engine.retain(calls)
    for call in calls:
        engine.prefetch(*call)


def score(
    task: Task,
    batch: RolloutBatch,
    records: Sequence[Record],
    cfg: TrainConfig,
    draws: Sequence[int] | None = None,
) -> Scored:
    """Task rewards and verdicts, plus the soft overlong punishment when configured.

    The punishment reads the whole response length (tool output included), the quantity
    ``rollout.max_new_tokens`` bounds.
    """
    rows = [records[g] for g in batch.group.tolist()]
    task_rewards = torch.tensor(
        [task.reward(text, rec) for text, rec in zip(batch.texts, rows, strict=True)],
        dtype=torch.float32,
    )
    correct = torch.tensor(
        [task.correct(text, rec) for text, rec in zip(batch.texts, rows, strict=True)],
        dtype=torch.bool,
    )
    rewards = task_rewards
    if cache := cfg.overlong_cache_tokens:
        lengths = batch.attention_mask.sum(-1).long().tolist()
        penalty = [soft_punishment(n, cfg.rollout.max_new_tokens, cache) for n in lengths]
        rewards = task_rewards + torch.tensor(penalty, dtype=torch.float32)
    draws = None if draws is None else list(draws)
    return Scored(batch, list(records), rewards, task_rewards, correct, draws=draws)


def informative_groups(scored: Scored, metric: str = "correct") -> Tensor:
    """BoolTensor[G]: dynamic sampling's filter (``filter.metric``): ``correct``, the groups
    with some responses correct and some not (DAPO's ``0 < #correct < n``); ``reward``, the
    groups whose shaped rewards are not all equal."""
    if metric not in ("correct", "reward"):
        raise ValueError(f"unknown dynamic-sampling metric {metric!r}: use correct or reward")
    values = scored.correct.float() if metric == "correct" else scored.rewards
    g, group = len(scored.records), scored.batch.group
    high = torch.full((g,), -torch.inf).scatter_reduce(0, group, values, "amax")
    low = torch.full((g,), torch.inf).scatter_reduce(0, group, values, "amin")
    return high > low


def collect(
    engine: Engine,
    sampler: PromptSampler,
    task: Task,
    cfg: TrainConfig,
    timer: Timer,
) -> tuple[Scored, dict[str, float]]:
    """Rollout -> rewards -> filter, in rounds when the filter drops groups.

    Returns the kept groups (possibly fewer than ``rollout.prompts_per_step``, even none,
    when dynamic sampling hits ``filter.max_rounds``) and metrics over every response
    generated this step: reward, accuracy, length, truncation, tool calls, rounds and
    kept groups.
    """
    want = cfg.rollout.prompts_per_step
    dynamic = cfg.filter.kind == "dynamic"
    rounds = 1
    generated: list[Scored] = []
    kept: list[Scored] = []
    while True:
        first = sampler.consumed
        records = sampler.take(want)
        draws = list(range(first, first + len(records)))
        with timer("generate"):
            batch = generate(engine, task, records, draws, cfg)
        with timer("score"):
            scored = score(task, batch, records, cfg, draws)
        generated.append(scored)
        if dynamic:
            scored = scored.select_groups(informative_groups(scored, cfg.filter.metric))
        kept.append(scored)
        have = sum(len(k.records) for k in kept)
        if have >= want or rounds >= cfg.filter.max_rounds:
            break
        rounds += 1
    out = Scored.cat(kept)
    if len(out.records) > want:
        out = out.select_groups(torch.arange(len(out.records)) < want)
    everything = Scored.cat(generated)
    return out, collect_metrics(everything, out, rounds)


def collect_metrics(generated: Scored, kept: Scored, rounds: int) -> dict[str, float]:
    """Response statistics over ``generated``, the filter's over ``kept`` (V0.5 pools top-ups in)."""
    batch = generated.batch
    lengths = batch.lengths.float()
    return {
        "reward/mean": generated.task_rewards.mean().item(),
        "reward/std": generated.task_rewards.std().item() if len(generated) > 1 else 0.0,
        "reward/shaped_mean": generated.rewards.mean().item(),
        "accuracy": generated.correct.float().mean().item(),
        "response/length": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": batch.truncated.float().mean().item(),
        "response/tool_calls": batch.tool_calls.float().mean().item(),
        "filter/rounds": float(rounds),
        "filter/kept_groups": float(len(kept.records)),
        "filter/kept_frac": len(kept.records) / len(generated.records),
        "rollouts/step": float(len(batch)),
        "tokens/step": float(batch.lengths.sum().item()),
    }
