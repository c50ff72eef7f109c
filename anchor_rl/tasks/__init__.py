"""Built-in verifiable tasks and dataset loaders, by name.

``get_task("arithmetic")``, ``get_task("countdown", n_train=500)``,
``get_task("multihop", reward="pvpo")``, ``get_task("file", path="gsm8k.jsonl", format="gsm8k")``.
"""

from __future__ import annotations

import inspect
from typing import Any

from anchor_rl.errors import BadArgumentsError, ConfigError
from anchor_rl.tasks.arithmetic import ArithmeticTask
from anchor_rl.tasks.base import GuardedTask, Record, Split, Task
from anchor_rl.tasks.countdown import CountdownTask
from anchor_rl.tasks.loaders import PRESETS, FileTask, Format
from anchor_rl.tasks.multihop import MultihopTask

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "multihop": MultihopTask,
    "file": FileTask,
}


def get_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as ``name`` with its constructor's keyword arguments."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid names: {', '.join(TASKS)}")
    cls = TASKS[name]
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(kwargs) - set(params) - {"self"})
    if unknown:
        valid = ", ".join(p for p in params if p != "self")
        raise BadArgumentsError(
            f"task {name!r} got unknown argument(s) {unknown}; it takes: {valid}"
        )
    return cls(**kwargs)


__all__ = [
    "PRESETS",
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "FileTask",
    "Format",
    "GuardedTask",
    "MultihopTask",
    "Record",
    "Split",
    "Task",
    "get_task",
]
