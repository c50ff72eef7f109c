"""SFT warm start: train a reference policy on a task's reference traces.

Each example is ``prompt (chat template) + task.trace(record) + eos``; the loss is the
token-mean cross-entropy over the trace's policy tokens and eos (prompt tokens and tool
result blocks carry no loss). Runs are cached by a hash of their configuration, so a
second call with the same settings returns the saved model at once.

Per-task defaults (``TASK_DEFAULTS``) are tuned so the tiny reference sits in the middle
of the difficulty range: see docs/testbed.md for the calibration. The built-in teacher
(``TEACHER_DEFAULTS``, the model spec ``teacher:SIZE``) trains longer on every record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from anchor_rl import threads
from anchor_rl.errors import ConfigError
from anchor_rl.interrupt import stop_signals
from anchor_rl.models import sft_state
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import save_policy
from anchor_rl.models.sft_stop import (
    CLASSES,
    ClassStop,
    ValidationStop,
    Validator,
    validation_slice,
)
from anchor_rl.models.tokenizer import build_tokenizer, encode_completion, encode_prompt
from anchor_rl.paths import cache_root
from anchor_rl.progress import Progress

if TYPE_CHECKING:
    from anchor_rl.tasks.base import Record, Task

_log = logging.getLogger(__name__)
SFT_VERSION = 3  # bump whenever a code change alters what a given config trains
GENERIC_DEFAULTS: dict[str, Any] = {"steps": 400, "lr": 3e-3, "batch_size": 32}
# Calibrated in docs/testbed.md. Arithmetic's learning curve is steep and lands each SFT seed
# elsewhere after a fixed step count, so its reference stops by the accuracy classes of a
# validation slice (ClassStop; ``steps`` is the budget).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "arithmetic": {"steps": 5000, "lr": 3e-3, "batch_size": 32, "class_stop": {"start": 1000}},
    "multihop": {"steps": 400, "lr": 3e-3, "batch_size": 32, "data_kwargs": {"hops": [2, 3]}},
}
# The built-in teacher (``teacher:SIZE``, PVPO's pi_gt): trained on all of the task's training
# data, no curriculum (every hop of multihop), and past the reference's point of its learning
# curve, so it solves what the reference cannot. Layered on TASK_DEFAULTS; a task without an
# entry trains twice the reference's steps.
TEACHER_DEFAULTS: dict[str, dict[str, Any]] = {
    "arithmetic": {"steps": 4000},
    "multihop": {"steps": 600},
}
ROLES = ("reference", "teacher")


@dataclass(frozen=True)
class SFTConfig:
    """Everything that determines an SFT run (and so its cache key).

    task, task_kwargs: the task name and constructor kwargs for ``get_task``.
    data_kwargs: kwargs layered on ``task_kwargs`` for the SFT data only (the reference's
    curriculum: multihop's default trains on 2- and 3-hop traces, so 4-hop questions lie
    beyond the reference; docs/testbed.md).
    size: a key of ``SIZES``. steps, batch_size: optimiser steps and sequences per step.
    lr: peak AdamW learning rate (linear warmup over ``warmup`` steps, cosine decay to
    ``lr / 10``). seed: model initialisation and data order.
    class_stop: stop where a validation slice of the training prompts has all three
    accuracy classes (:class:`ClassStop`; ``steps`` is then the budget); None: train
    exactly ``steps`` steps on every training record.
    """

    task: str
    size: str = "tiny"
    steps: int = GENERIC_DEFAULTS["steps"]
    lr: float = GENERIC_DEFAULTS["lr"]
    batch_size: int = GENERIC_DEFAULTS["batch_size"]
    seed: int = 0
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    class_stop: ClassStop | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "class_stop", ClassStop.parse(self.class_stop))
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def key(self) -> str:
        """A 16-hex-digit hash of the config and ``SFT_VERSION`` (a config without
        ``class_stop`` hashes as it did before the field existed)."""
        values = asdict(self)
        if values["class_stop"] is None:
            del values["class_stop"]
        blob = json.dumps({"version": SFT_VERSION, **values}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_config(
    task: str, size: str = "tiny", role: str = "reference", **overrides: Any
) -> SFTConfig:
    """The config for ``task`` with its tuned defaults; ``None`` overrides are ignored.

    role: ``reference`` (the policy's warm start, ``TASK_DEFAULTS``) or ``teacher`` (the
    same with ``TEACHER_DEFAULTS`` on top and no curriculum: every training record).
    ``task_kwargs`` the task names in ``scoring_kwargs`` (multihop's ``reward``) are dropped:
    they change no record or trace, so the reference is the same model with or without them.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    values = {**GENERIC_DEFAULTS, **TASK_DEFAULTS.get(task, {})}
    if role == "teacher":
        uncalibrated = {"data_kwargs": {}, "steps": 2 * values["steps"], "class_stop": None}
        values.update({**uncalibrated, **TEACHER_DEFAULTS.get(task, {})})
    values.update({k: v for k, v in overrides.items() if v is not None})
    for name in ("task_kwargs", "data_kwargs"):
        values[name] = dict(values.get(name) or {})  # None and {} hash alike
    from anchor_rl.tasks import TASKS

    scoring = getattr(TASKS.get(task), "scoring_kwargs", frozenset())
    values["task_kwargs"] = {k: v for k, v in values["task_kwargs"].items() if k not in scoring}
    return SFTConfig(task=task, size=size, **values)


def sft_dir(cfg: SFTConfig, out: str | Path | None = None) -> Path:
    """Where a run of ``cfg`` lives: ``out`` or ``cache_root() / "sft" / cfg.key()``."""
    return Path(out) if out is not None else cache_root() / "sft" / cfg.key()


def sft_example(
    tokenizer: PreTrainedTokenizerBase, task: Task, record: Record
) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of one training sequence: prompt, trace and eos."""
    prompt = encode_prompt(tokenizer, record.prompt, task.instruction)
    response, policy = encode_completion(tokenizer, task.trace(record))
    ids = [*prompt, *response, tokenizer.eos_token_id]
    mask = [0] * len(prompt) + [int(p) for p in policy] + [1]
    return ids, mask


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into ``input_ids[B, L]``, ``attention_mask[B, L]``, ``loss_mask[B, L]``."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss = torch.zeros((len(examples), width))
    for i, (row, mask) in enumerate(examples):
        ids[i, : len(row)] = torch.as_tensor(row)
        attention[i, : len(row)] = 1
        loss[i, : len(row)] = torch.as_tensor(mask, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean next-token cross-entropy over positions with ``loss_mask`` 1."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return (nll * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)


def sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    grad_clip: float,
) -> float:
    """One optimiser step on ``batch`` (:func:`collate`'s tensors, ``[B, L]``) at the
    optimiser's current learning rate, gradients clipped to ``grad_clip``; the loss."""
    loss = sft_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warmup to ``cfg.lr`` then cosine decay to ``cfg.lr / 10`` at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def length_bucketed_batches(
    lengths: list[int], batch_size: int, steps: int, generator: torch.Generator, pool: int = 16
):
    """``steps`` index batches, every example once per epoch (seeded permutations).

    Indices are taken ``pool`` batches at a time, sorted by length, cut into batches and
    yielded in a shuffled order, so a batch holds similar lengths and little padding.
    """
    order: list[int] = []
    pending: list[list[int]] = []
    for _ in range(steps):
        if not pending:
            while len(order) < batch_size * pool:
                order += torch.randperm(len(lengths), generator=generator).tolist()
            chunk, order = (
                sorted(order[: batch_size * pool], key=lengths.__getitem__),
                order[batch_size * pool :],
            )
            batches = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
            pending = [
                batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()
            ]
        yield pending.pop()


def save_loss_curve(losses: list[float], path: Path, title: str) -> None:
    """Plot per-step loss with a moving average to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(losses) // 50)
    smooth = [
        sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
        for i in range(len(losses))
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, alpha=0.3, label="loss")
    ax.plot(smooth, label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def is_complete(path: Path, cfg: SFTConfig) -> bool:
    """Whether ``path`` holds a finished run of exactly ``cfg``."""
    meta = path / "sft_config.json"
    if not meta.is_file() or not (path / "config.json").is_file():
        return False
    return json.loads(meta.read_text()).get("key") == cfg.key()


def run_sft(
    cfg: SFTConfig,
    out: Path,
    progress: bool = True,
    validate: Validator | None = None,
    state: Path | None = None,
) -> list[float]:
    """Train per ``cfg`` and save model, tokenizer, ``sft_config.json``, ``loss.json`` and
    ``loss_curve.png`` to ``out`` (with ``cfg.class_stop``, also ``class_stop.json``: every
    validation evaluation and the step kept). Returns the per-step losses.

    validate: how ``cfg.class_stop`` evaluates the live model (:data:`Validator`; the
    sampling engine sits a layer above this package, so the caller passes
    ``anchor_rl.rollout.evaluate.class_shares``); required with a class stop.
    state: where SIGTERM or Ctrl-C keeps the run's state, and a stopped run of ``cfg``
    continues from (:mod:`anchor_rl.models.sft_state`; None: an interrupted run keeps nothing).
    """
    if cfg.class_stop is not None and validate is None:
        raise ValueError(
            "class_stop needs a validator: pass validate=anchor_rl.rollout.evaluate.class_shares"
        )

    from anchor_rl.tasks import get_task

    task = get_task(cfg.task, **{**cfg.task_kwargs, **cfg.data_kwargs})
    tokenizer = build_tokenizer()
    records = task.records("train")
    stop = cfg.class_stop
    validation: list[Record] = []
    if stop is not None:
        if why := class_stop_shortfall(cfg, len(records)):
            raise ConfigError(
                f"{why}: give the task more training records, or a smaller val_prompts "
                f"(--class-stop '{{\"val_prompts\": N}}'), or --class-stop off"
            )
        records, validation = validation_slice(records, task.records("test"), stop.val_prompts)
    if not records:
        raise ValueError(f"task {cfg.task!r} has no train records")
    examples = [sft_example(tokenizer, task, r) for r in records]
    model = build_model(cfg.size, tokenizer, seed=cfg.seed)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    checks = None
    if stop is not None and validate is not None:
        checks = ValidationStop(stop, validate, model, tokenizer, task, validation)
    start, losses = sft_state.load_state(state, cfg.key(), model, optimizer, checks)
    label = f"sft {cfg.task}/{cfg.size}"
    if progress:
        print(f"{label}: {sft_state.stop_rule(cfg, start)}")
    if progress and (chosen := threads.choice_for(model)) is not None:
        print(f"{label}: {chosen.line(('sft', 'generate'))}")
    with (
        threads.phase("sft", model),
        stop_signals(sft_state.stop_notice(state)) as interrupt,
        Progress(label, cfg.steps, done=start, enabled=progress) as bar,
    ):
        lengths = [len(ids) for ids, _ in examples]
        batches = length_bucketed_batches(lengths, cfg.batch_size, cfg.steps, generator)
        for step, idx in enumerate(batches):
            if step < start:
                continue  # the data order replayed up to where the interrupted run stopped
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            batch = collate([examples[i] for i in idx], tokenizer.pad_token_id)
            losses.append(sft_step(model, optimizer, batch, cfg.grad_clip))
            done = (
                checks is not None and checks.due(step + 1, cfg.steps) and checks.evaluate(step + 1)
            )
            info = f"loss {losses[-1]:.4f}"
            if checks is not None:
                info += f" | {checks.describe() if checks.evals else 'stops when classes settle'}"
            bar.update(advance=1, info=info)
            if done:
                break
            if interrupt.requested and step + 1 < cfg.steps:
                kept = sft_state.keep(state, cfg, step + 1, model, optimizer, losses, checks)
                raise interrupt.stop(f"{label} {kept}")
    if checks is not None:
        checks.restore()
        kept = checks.summary()
        if not kept["met_target"]:
            _log.warning(
                "class_stop: no validation evaluation had %.0f%% of the prompts in every "
                "accuracy class; kept step %d (%s). See docs/testbed.md",
                100 * checks.stop.min_share, kept["kept_step"],
                ", ".join(f"{c} {kept['kept'][c]:.2f}" for c in CLASSES),
            )  # fmt: skip
        if progress:
            print(f"{label}: {sft_state.stopped_by(cfg, len(losses), kept)}")
    model.eval()
    save_policy(model, tokenizer, out)
    if checks is not None:
        (out / "class_stop.json").write_text(json.dumps(kept, indent=2))
    (out / "loss.json").write_text(json.dumps(losses))
    save_loss_curve(losses, out / "loss_curve.png", f"SFT {cfg.task} / {cfg.size}")
    (out / "sft_config.json").write_text(
        json.dumps({"key": cfg.key(), "version": SFT_VERSION, **asdict(cfg)}, indent=2)
    )
    return losses


def class_stop_shortfall(cfg: SFTConfig, train_records: int) -> str | None:
    """Why ``cfg``'s class stop cannot hold out its validation slice from a task of
    ``train_records`` training records (it needs more than ``val_prompts``); None when it can
    or there is no class stop."""
    stop = cfg.class_stop
    if stop is None or train_records > stop.val_prompts:
        return None
    data = {**cfg.task_kwargs, **cfg.data_kwargs}
    args = f" with {json.dumps(data, sort_keys=True)}" if data else ""
    return (
        f"the SFT of task {cfg.task!r} stops by its accuracy classes on a validation slice of "
        f"class_stop.val_prompts={stop.val_prompts} training records, and the task{args} has "
        f"only {train_records}"
    )


def train_sft(
    task_name: str,
    size: str = "tiny",
    *,
    steps: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
    data_kwargs: dict[str, Any] | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    role: str = "reference",
    class_stop: ClassStop | dict[str, Any] | bool | None = None,
    validate: Validator | None = None,
) -> Path:
    """Train (or fetch from cache) the SFT reference for a task; returns its directory.

    ``None`` arguments take the task's tuned defaults (``TASK_DEFAULTS``; with
    ``role="teacher"``, the built-in teacher's: ``TEACHER_DEFAULTS``, no curriculum;
    ``class_stop=False`` turns a task's default early stop off; a class stop needs
    ``validate``, see :func:`run_sft`). Without
    ``out`` the model goes to ``cache_root() / "sft" / <config hash>``. A directory that
    already holds a finished run of the same config is returned without training; a run
    is written to a temporary sibling first and moved into place when complete.
    """
    cfg = default_config(
        task_name,
        size,
        role,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        task_kwargs=task_kwargs,
        data_kwargs=data_kwargs,
        class_stop=class_stop,
    )
    path = sft_dir(cfg, out)
    if is_complete(path, cfg):
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists and does not hold this SFT config; choose another --out"
        )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        run_sft(cfg, tmp, progress=progress, validate=validate, state=sft_state.partial_dir(path))
        if is_complete(path, cfg):  # a concurrent run of the same config finished first
            return path
        if path.exists():
            path.rmdir()
        tmp.rename(path)
        sft_state.drop_state(sft_state.partial_dir(path))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
