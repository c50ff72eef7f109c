"""Controls for the testbed: SFT continued instead of RL, and the reference at its plateau.

The default arithmetic reference (``sft:tiny``) is a class-stopped SFT run: its saved
weights are the evaluated step whose thinnest accuracy class was largest
(``class_stop.json``'s ``kept_step``), in the middle of a cosine schedule. Two questions
about RL's held-out gain from it (docs/testbed.md, "Controls"):

- would the same compute spent on more SFT give the same gain? :func:`continue_sft`
  continues the SFT from the saved weights on the SFT's own training records (the
  validation slice still held out), at the learning rate its schedule has at the kept
  step and after (:func:`continuation_lr`); the optimiser state is not saved with the
  reference, so AdamW starts fresh and the learning rate warms up again over the SFT's
  ``warmup`` steps. Its data order is a fresh seeded stream of epochs
  (:func:`~anchor_rl.models.sft.length_bucketed_batches` seeded by the control's seed).
  The compute is matched to a GRPO run in two ways (:func:`token_matched_steps`: equal
  updated tokens; :func:`time_matched_steps`: equal wall time, timed alternately on one
  machine by :func:`time_alternately`).
- does a method comparison keep its direction from a second starting point? The reference
  continued until its validation avg@8 stops improving (:class:`PlateauStop`).

Held-out accuracy is measured by the suites' own code path
(:func:`anchor_rl.trainer.run.evaluate_model` with a suite run's config).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anchor_rl.models.sft import (
    SFTConfig,
    collate,
    length_bucketed_batches,
    lr_at,
    sft_example,
    sft_step,
)
from anchor_rl.models.sft_stop import validation_slice


def continuation_lr(cfg: SFTConfig, start: int, i: int) -> float:
    """Learning rate of continuation step ``i`` (0-based) from a reference saved after
    ``start`` steps of ``cfg``: the schedule's rate at step ``start + i`` (held at its floor,
    ``lr / 10``, past ``cfg.steps``), ramped linearly over the first ``cfg.warmup`` steps
    because the continuation's AdamW starts without moment estimates."""
    rate = lr_at(min(start + i, cfg.steps), cfg)
    return rate * min(1.0, (i + 1) / max(1, cfg.warmup))


def token_matched_steps(updated_tokens: float, tokens_per_step: float) -> int:
    """SFT steps whose loss tokens (``tokens_per_step`` each, on average) reach
    ``updated_tokens``, the policy tokens an RL run updated on (rounded up)."""
    if tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be > 0, got {tokens_per_step}")
    return max(1, math.ceil(updated_tokens / tokens_per_step))


def time_matched_steps(
    rl_seconds_per_step: float, rl_steps: int, sft_seconds_per_step: float
) -> int:
    """SFT steps that take the wall time of ``rl_steps`` RL steps (rounded to nearest)."""
    if sft_seconds_per_step <= 0:
        raise ValueError(f"sft_seconds_per_step must be > 0, got {sft_seconds_per_step}")
    return max(1, round(rl_steps * rl_seconds_per_step / sft_seconds_per_step))


@dataclass
class SFTData:
    """The SFT's training examples (``(ids, loss_mask)`` each) and validation records."""

    examples: list[tuple[list[int], list[int]]]
    validation: list[Any]
    task: Any
    pad_id: int

    @property
    def loss_tokens_per_example(self) -> float:
        """Mean loss-mask tokens of one example (trace policy tokens and eos)."""
        return sum(sum(m) for _, m in self.examples) / len(self.examples)


def sft_data(cfg: SFTConfig, tokenizer: Any) -> SFTData:
    """The records ``cfg``'s SFT trained on, as examples (its validation slice held out as in
    :func:`~anchor_rl.models.sft.run_sft`)."""
    from anchor_rl.tasks import get_task

    task = get_task(cfg.task, **{**cfg.task_kwargs, **cfg.data_kwargs})
    records, validation = task.records("train"), []
    if cfg.class_stop is not None:
        records, validation = validation_slice(
            records, task.records("test"), cfg.class_stop.val_prompts
        )
    examples = [sft_example(tokenizer, task, r) for r in records]
    return SFTData(examples, validation, task, tokenizer.pad_token_id)


@dataclass
class Continuation:
    """SFT continued from a reference: the live model and its optimiser, stepped by
    :meth:`step`; ``done`` steps taken, ``seconds`` spent in them (updates only)."""

    model: torch.nn.Module
    cfg: SFTConfig
    start: int
    data: SFTData
    seed: int
    horizon: int
    done: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=self.cfg.weight_decay,
        )
        lengths = [len(ids) for ids, _ in self.data.examples]
        generator = torch.Generator().manual_seed(self.seed)
        self._batches = length_bucketed_batches(
            lengths, self.cfg.batch_size, self.horizon, generator
        )

    def step(self, n: int = 1) -> None:
        """Take ``n`` more continuation steps (at most ``horizon`` in all)."""
        for _ in range(n):
            idx = next(self._batches)
            batch = collate([self.data.examples[i] for i in idx], self.data.pad_id)
            for group in self.optimizer.param_groups:
                group["lr"] = continuation_lr(self.cfg, self.start, self.done)
            t0 = time.perf_counter()
            self.losses.append(sft_step(self.model, self.optimizer, batch, self.cfg.grad_clip))
            self.seconds += time.perf_counter() - t0
            self.done += 1


def continue_sft(
    reference: Path,
    cfg: SFTConfig,
    start: int,
    seed: int,
    checkpoints: Iterable[int],
    measure: Callable[[torch.nn.Module, Any, int], dict[str, Any]],
    data: SFTData | None = None,
) -> list[dict[str, Any]]:
    """Continue ``cfg``'s SFT from the model in ``reference`` (saved after ``start`` steps)
    and call ``measure(model, tokenizer, steps)`` after each of ``checkpoints`` steps (the
    model in eval mode for it); its results, each with ``steps``, ``sft_seconds`` and the
    mean loss of the steps since the previous checkpoint."""
    from anchor_rl.models.loading import load_policy

    model, tokenizer = load_policy(reference)
    data = data or sft_data(cfg, tokenizer)
    points = sorted(set(checkpoints))
    run = Continuation(model, cfg, start, data, seed, horizon=max(points))
    out = []
    for point in points:
        before = len(run.losses)
        run.step(point - run.done)
        model.eval()
        result = measure(model, tokenizer, point)
        model.train()
        losses = run.losses[before:]
        out.append({"steps": point, "sft_seconds": run.seconds,
                    "loss": sum(losses) / len(losses) if losses else None, **result})  # fmt: skip
    return out


@dataclass(frozen=True)
class PlateauStop:
    """Continue SFT until validation avg@k stops improving.

    Every ``every`` steps the validation slice is sampled (``k`` samples at T = 1); the run
    stops after ``patience`` evaluations in a row that do not beat the best by more than
    ``min_delta``, or at ``max_steps``, and keeps the best evaluation's weights.
    """

    every: int = 200
    patience: int = 3
    min_delta: float = 0.01
    max_steps: int = 2900
    k: int = 8

    def stop_after(self, history: Sequence[float]) -> bool:
        """Whether the evaluations ``history`` (avg@k, in order) end the run."""
        if len(history) <= self.patience:
            return False
        best_before = max(history[: -self.patience])
        return all(x <= best_before + self.min_delta for x in history[-self.patience :])

    def best(self, history: Sequence[float]) -> int:
        """Index of the kept evaluation: the first with the largest avg@k."""
        return max(range(len(history)), key=lambda i: (history[i], -i))


def train_to_plateau(
    reference: Path,
    cfg: SFTConfig,
    start: int,
    rule: PlateauStop,
    validate: Callable[..., dict[str, float]],
    out: Path,
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Continue ``cfg``'s SFT from ``reference`` per ``rule``, evaluating the validation slice
    with ``validate`` (``anchor_rl.rollout.evaluate.class_shares``), and save the kept
    weights to ``out`` as a model directory with ``plateau.json`` (every evaluation, the
    kept step, the rule). Returns what ``plateau.json`` holds."""
    from anchor_rl.models.loading import load_policy, save_policy

    model, tokenizer = load_policy(reference)
    data = sft_data(cfg, tokenizer)
    run = Continuation(model, cfg, start, data, seed, horizon=rule.max_steps)
    evals: list[dict[str, Any]] = []
    best_state = None
    history: list[float] = []

    def evaluate() -> None:
        nonlocal best_state
        model.eval()
        shares = validate(model, tokenizer, data.task, data.validation, rule.k)
        model.train()
        evals.append({"steps": run.done, "sft_step": start + run.done, **shares})
        history.append(shares[f"avg@{rule.k}"])
        if rule.best(history) == len(history) - 1:
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        echo(f"plateau: +{run.done} steps, validation avg@{rule.k} {history[-1]:.3f}")

    evaluate()
    while run.done < rule.max_steps and not rule.stop_after(history):
        run.step(min(rule.every, rule.max_steps - run.done))
        evaluate()
    kept = evals[rule.best(history)]
    assert best_state is not None
    model.load_state_dict(best_state)
    model.eval()
    save_policy(model, tokenizer, out)
    summary = {
        "reference_step": start,
        "rule": rule.__dict__,
        "seed": seed,
        "stopped_after": run.done,
        "kept": kept,
        "evaluations": evals,
        "sft_seconds": run.seconds,
    }
    (Path(out) / "plateau.json").write_text(json.dumps(summary, indent=2))
    return summary


def time_alternately(
    rl: Callable[[], tuple[float, int]], sft: Callable[[], tuple[float, int]], rounds: int
) -> dict[str, Any]:
    """Time RL and SFT steps in alternation (RL, SFT, RL, SFT...), ``rounds`` each, so that
    both see the same machine load; each callable returns ``(seconds, steps)``. Returns the
    per-round seconds per step and their medians."""
    rl_rates, sft_rates = [], []
    for _ in range(rounds):
        seconds, steps = rl()
        rl_rates.append(seconds / steps)
        seconds, steps = sft()
        sft_rates.append(seconds / steps)
    return {
        "rl_seconds_per_step": rl_rates,
        "sft_seconds_per_step": sft_rates,
        "rl_median": statistics.median(rl_rates),
        "sft_median": statistics.median(sft_rates),
    }


def gain(accuracies: Sequence[float], start: float) -> dict[str, float]:
    """Mean held-out accuracy over seeds and its gain over ``start``, with the seeds' range."""
    mean = sum(accuracies) / len(accuracies)
    return {"mean": mean, "gain": mean - start, "min": min(accuracies), "max": max(accuracies)}
