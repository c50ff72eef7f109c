"""Option parsing and settings several commands share."""

from __future__ import annotations

import json
import os
from typing import Any

import typer


def default_threads() -> int:
    """Torch threads for a command: ``$OMP_NUM_THREADS`` if set, else the cores this process
    may run on. (On a machine shared with other jobs, 1 thread is often much faster for the
    tiny models: idle OpenMP workers contend for the busy cores.)"""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
