"""Option parsing and settings several commands share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from anchor_rl.threads import (
    ONE_THREAD_BELOW,
    Setting,
    choose_threads,
    configure,
    parse_setting,
)

THREADS_HELP = (
    f"Torch threads: auto (one thread for models below {ONE_THREAD_BELOW['generate'] // 10**6}M "
    "parameters, all cores above) or a number; wins over $OMP_NUM_THREADS."
)
ThreadsOption = Annotated[str, typer.Option("--threads", help=THREADS_HELP)]
"""The ``--threads auto|N`` option of the commands that run a model in this process."""
TaskKwargsOpt = Annotated[
    str | None, typer.Option(help="Task constructor kwargs as a JSON object.")
]
DeviceOpt = Annotated[str, typer.Option(help="Torch device.")]
AdapterOpt = Annotated[
    Path | None,
    typer.Option(
        help="A LoRA adapter directory (PEFT format: a LoRA run's checkpoint policy/) applied to "
        "--model, its base model, merged into its weights."
    ),
]
TokenizerOpt = Annotated[
    Path | None,
    typer.Option(
        help="Tokenizer directory for an http: model whose server does not serve its tokenizer "
        "(anchor-rl serve does)."
    ),
]


def use_threads(text: str) -> Setting:
    """Let this process pick its torch threads per phase (:mod:`anchor_rl.threads`) under
    ``--threads``; ``typer.BadParameter`` for anything but ``auto`` or a count >= 1."""
    try:
        setting = parse_setting(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--threads") from None
    configure(setting)
    return setting


def default_threads() -> int:
    """Torch threads for a command whose model's size is not known yet: ``$OMP_NUM_THREADS``
    if set, else the cores this process may use (:func:`anchor_rl.threads.choose_threads`)."""
    return choose_threads(None).update


def parse_task_kwargs(text: str | None, hint: str = "--task-kwargs") -> dict[str, Any]:
    """A JSON object of task constructor kwargs; ``typer.BadParameter`` if it is not one."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint=hint) from exc
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object like '{\"key\": 1}'", param_hint=hint)
    return value


def sampling_option(**fields: Any) -> Any:
    """``SamplingParams(**fields)`` of the sampling options; ``typer.BadParameter`` saying
    why they cannot sample (e.g. ``--top-p 0``)."""
    from anchor_rl.rollout.types import SamplingParams

    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def load_model(
    model: str,
    task: str,
    task_kwargs: dict[str, Any],
    seed: int,
    device: str,
    adapter: Path | str | None = None,
) -> tuple[Any, Any]:
    """The policy and tokenizer a ``--model`` spec loads (``load_spec``), a LoRA ``--adapter``
    merged into its weights; ``typer.BadParameter`` naming the option at fault."""
    from anchor_rl.errors import AnchorRLError
    from anchor_rl.rollout.spec import load_spec

    try:
        policy, tokenizer = load_spec(model, task, task_kwargs, seed, device)
    except (ValueError, AnchorRLError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from exc
    if adapter is not None:
        from anchor_rl.models.lora import load_adapter, merge_adapter

        try:
            policy = merge_adapter(load_adapter(policy, adapter))
        except AnchorRLError as exc:
            raise typer.BadParameter(str(exc), param_hint="--adapter") from exc
    return policy, tokenizer


def served(model: str, tokenizer_dir: Path | None) -> Any:
    """The ``http`` engine of an ``http:URL[#MODEL]`` spec (the tokenizer from ``tokenizer_dir``,
    else the one the server serves); ``typer.BadParameter`` naming ``--model``."""
    from anchor_rl.rollout.http import connect, load_tokenizer
    from anchor_rl.rollout.spec import bare_url

    if why := bare_url(model):  # http://... starts with "http:" too
        raise typer.BadParameter(why, param_hint="--model")
    try:
        tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        return connect(model, tokenizer)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from exc


def open_engine(
    model: str,
    task: str,
    task_kwargs: dict[str, Any],
    seed: int,
    device: str,
    tokenizer_dir: Path | None,
    adapter: Path | None = None,
    freeze: bool = False,
) -> tuple[Any, Any, Any]:
    """``(engine, policy, tokenizer)`` of a ``--model``: ``http:URL`` samples through the
    ``http`` engine (:func:`served`; policy None), anything else is loaded here
    (:func:`load_model`, ``freeze``: as a frozen reference) and samples with the ``hf`` engine."""
    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.rollout.spec import frozen

    if model.startswith("http:"):  # http://... too: served() names the fix
        if adapter is not None:
            raise typer.BadParameter(
                "--adapter applies to a model loaded here; load the adapter into the server "
                "instead (anchor-rl serve --adapter)",
                param_hint="--adapter",
            )
        engine = served(model, tokenizer_dir)
        return engine, None, engine.tokenizer
    policy, tokenizer = load_model(model, task, task_kwargs, seed, device, adapter)
    policy = frozen(policy) if freeze else policy
    return make_engine("hf", policy, tokenizer), policy, tokenizer
