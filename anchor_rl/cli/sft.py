"""``anchor-rl sft``: train (or fetch from cache) the SFT reference policy of a task.

torch and transformers are imported inside the command so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from anchor_rl.cli.options import TaskKwargsOpt, ThreadsOption, parse_task_kwargs, use_threads


def parse_class_stop(text: str | None) -> dict[str, Any] | bool | None:
    """``--class-stop``: None (the task's default), ``on``, ``off`` or a JSON object."""
    if text is None:
        return None
    if text.strip().lower() in ("on", "off"):
        return text.strip().lower() == "on"
    return parse_task_kwargs(text, "--class-stop")


def sft(
    task: Annotated[
        str, typer.Option(help="Task name (see anchor_rl.tasks.get_task).")
    ] = "arithmetic",
    size: Annotated[
        str, typer.Option(help="Model size: tiny (~1M), small (~10M), base (~50M).")
    ] = "tiny",
    steps: Annotated[
        int | None,
        typer.Option(
            help="Optimiser steps (with --class-stop: the most it may take). "
            "Default: the task's tuned value."
        ),
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate. Default: the task's tuned value.")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Sequences per step. Default: the task's tuned value.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the initialisation and the data order.")] = 0,
    task_kwargs: TaskKwargsOpt = None,
    data_kwargs: Annotated[
        str | None,
        typer.Option(
            help="Kwargs layered on --task-kwargs for the SFT data only, as a JSON object "
            '(the curriculum). Default: the task\'s tuned value (multihop: {"hops": [2, 3]}).'
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Model directory. Default: $ANCHOR_RL_CACHE/sft/<config hash>."),
    ] = None,
    class_stop: Annotated[
        str | None,
        typer.Option(
            help="Stop where a validation slice of the training prompts has all three accuracy "
            "classes: 'on' (defaults), 'off', or a JSON object of ClassStop fields "
            "(min_share, val_prompts, every, start, k, coarse). Default: the task's tuned value."
        ),
    ] = None,
    teacher: Annotated[
        bool,
        typer.Option(
            "--teacher",
            help="Train the task's built-in teacher (the model spec teacher:SIZE): every "
            "training record, no curriculum, the teacher's step count.",
        ),
    ] = False,
    threads: ThreadsOption = "auto",
) -> None:
    """Train a tiny model on the task's reference traces (loss on response tokens only).

    Runs are cached by a hash of their configuration; a second call prints the path at once.
    The directory holds the model, its tokenizer, sft_config.json, loss.json and loss_curve.png.
    """
    import transformers

    from anchor_rl.models.factory import SIZES
    from anchor_rl.models.sft import TASK_DEFAULTS, default_config, is_complete, sft_dir, train_sft
    from anchor_rl.rollout.evaluate import class_shares
    from anchor_rl.tasks import TASKS

    role = "teacher" if teacher else "reference"
    if size not in SIZES:
        raise typer.BadParameter(
            f"unknown size {size!r}; choose one of {', '.join(SIZES)}", param_hint="--size"
        )
    if task not in TASKS:
        raise typer.BadParameter(
            f"unknown task {task!r}; choose one of {', '.join(TASKS)}", param_hint="--task"
        )
    kwargs = parse_task_kwargs(task_kwargs)
    data = None if data_kwargs is None else parse_task_kwargs(data_kwargs, "--data-kwargs")
    stop = parse_class_stop(class_stop)
    transformers.utils.logging.disable_progress_bar()
    use_threads(threads)
    settings: dict[str, Any] = {
        "steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "task_kwargs": kwargs,
        "data_kwargs": data, "class_stop": stop,
    }  # fmt: skip
    try:
        cfg = default_config(task, size, role, **settings)
    except (TypeError, ValueError) as exc:  # a bad --steps, --lr or --class-stop field
        raise typer.BadParameter(str(exc)) from exc
    cached = is_complete(sft_dir(cfg, out), cfg)
    source = "tuned for this task" if task in TASK_DEFAULTS else "generic defaults"
    typer.echo(
        f"SFT {task}/{size}{' teacher' if teacher else ''}: steps={cfg.steps} lr={cfg.lr} batch_size={cfg.batch_size}"
        + (f" data_kwargs={json.dumps(cfg.data_kwargs)}" if cfg.data_kwargs else "")
        + (f" class_stop={json.dumps(asdict(cfg.class_stop))}" if cfg.class_stop else "")
        + f" ({source})"
    )
    path = train_sft(task, size, **settings, out=out, role=role, validate=class_shares)
    typer.echo(
        "cached, not retrained:" if cached else f"trained; loss curve: {path / 'loss_curve.png'}"
    )
    typer.echo(path)
