"""Option parsing and settings several commands share."""

from __future__ import annotations

import json
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
