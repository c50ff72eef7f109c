"""A run's own reward: the task's verifier and TRL-convention reward functions, weighted.

A new reward does not need a new task: :class:`RewardedTask` wraps any task and replaces
its ``reward`` by ``task_weight * task.reward + sum_i w_i * f_i``, where each ``f_i`` has
TRL's signature ``f(prompts, completions, **columns) -> list[float | None]`` (a built-in
name of :data:`anchor_rl.rewards.REWARD_FUNCTIONS`, an importable ``module:function``, or
such a function itself, which goes by that name: :func:`reward_function_name`).
The columns are ``answer`` (the record's gold answer: a string, or, when the record has
aliases in ``meta["aliases"]``, the list of the gold answer and its aliases), ``prompt_id``
and the record's ``meta`` fields. A ``None`` reward, a raising call and a timed-out one add
nothing for that completion (the failures are counted, :attr:`RewardedTask.verifiers`, and
:meth:`RewardedTask.verifier_stats` adds them to the task's own).

What "correct" means does not change: ``correct`` stays the task's own verdict, the
accuracy every metric and PVPO's group sampling read. The training reward, the anchors
presampled under it and ``eval/reward`` use the weighted sum; the store key of anchors
carries :meth:`RewardedTask.reward_spec`, so anchors presampled under another reward are
never reused.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from anchor_rl.rewards.functions import REWARD_FUNCTIONS, RewardFunction
from anchor_rl.rewards.safe import SafeVerifier
from anchor_rl.tasks.base import Record, Split, Task, sum_stats

VERIFIER_TIMEOUT = 10.0
"""Seconds a reward function may take on one completion before it counts as failed."""


def reward_function_name(function: str | RewardFunction) -> str:
    """The name a reward function goes by in the anchors' store key and the failure counts: a
    string as given; a built-in function by its built-in name; any other function as
    ``module:qualname``, which must import back to that very function (so the key names the
    same function in every run that passes it, by name or by object; like a string, the name
    stands for the code). ValueError for a lambda, a nested function, a method or another
    callable that no ``module:function`` names."""
    if isinstance(function, str):
        return function
    for name, builtin in REWARD_FUNCTIONS.items():
        if builtin is function:
            return name
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    found = None
    if module and qualname and "." not in qualname and "<" not in qualname:
        try:
            found = getattr(importlib.import_module(module), qualname, None)
        except ImportError:
            found = None
    if found is None or found is not function:
        raise ValueError(
            f"reward function {function!r}: a reward function is named in the anchors' key by "
            "module:function, and no importable module:function names this one (a lambda, "
            "nested function, method or callable object); define it at module level, or pass "
            "a built-in name or a 'module:function' string"
        )
    return f"{module}:{qualname}"


def resolve_reward_function(name: str) -> RewardFunction:
    """A built-in reward function by name, or ``module:function`` imported; ValueError naming
    the built-in ones otherwise."""
    if not isinstance(name, str):
        raise ValueError(
            f"reward function {name!r}: a built-in name or a 'module:function' string "
            "(RewardedTask and with_rewards also take module-level functions)"
        )
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"unknown reward function {name!r}; built-in: {', '.join(sorted(REWARD_FUNCTIONS))}, "
            "or module:function"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward function {name!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    return fn


ANSWER_COLUMN = "gold and aliases"
"""What a reward function's ``answer`` column holds: the record's answer, or the list of it
and its aliases where the record has any (``meta["aliases"]``)."""


class RewardedTask(Task):
    """``task`` with its reward replaced by a weighted sum (see the module docstring).

    Args:
        task: the task whose records, verifier (``correct``), trace, tools and stops are used.
        functions: reward function names (:func:`resolve_reward_function`) or module-level
            functions (TRL's ``reward_funcs``), which go by :func:`reward_function_name`: their
            ``module:function`` or built-in name, in :attr:`functions` and the store key.
        weights: one per function (TRL's ``reward_weights``); None: 1 each.
        task_weight: the weight of ``task.reward``; 0 leaves the functions alone.
    """

    def __init__(
        self,
        task: Task,
        functions: Sequence[str | RewardFunction],
        weights: Sequence[float] | None = None,
        task_weight: float = 1.0,
    ) -> None:
        super().__init__()
        given = {reward_function_name(f): f for f in functions}
        functions = [reward_function_name(f) for f in functions]
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions")
        if not functions and task_weight == 0:
            raise ValueError("no reward: task_weight is 0 and no reward function is given")
        self.task, self.functions, self.weights = task, list(functions), weights
        self.task_weight = float(task_weight)
        self.verifiers: dict[str, SafeVerifier] = {
            name: SafeVerifier(f if callable(f) else resolve_reward_function(f), on_error=None,
                               timeout=VERIFIER_TIMEOUT, name=name)
            for name, f in given.items()
        }  # fmt: skip
        self.name = task.name
        self.instruction = task.instruction
        self.tools = task.tools

    def records(self, split: Split) -> list[Record]:
        return self.task.records(split)

    def trace(self, record: Record) -> str:
        return self.task.trace(record)

    def correct(self, completion: str, record: Record) -> bool:
        """The task's own verdict (the accuracy metric), whatever the reward."""
        return self.task.correct(completion, record)

    def reward(self, completion: str, record: Record) -> float:
        total = self.task_weight * self.task.reward(completion, record) if self.task_weight else 0.0
        aliases = record.meta.get("aliases") or []
        gold: str | list[str] = [record.answer, *aliases] if aliases else record.answer
        columns: dict[str, Any] = {"answer": [gold], "prompt_id": [record.id]}
        columns |= {key: [value] for key, value in record.meta.items() if key not in columns}
        for name, weight in zip(self.functions, self.weights, strict=True):
            values = self.verifiers[name].map([record.prompt], [completion], **columns)
            if values[0] is not None:
                total += weight * float(values[0])
        return total

    @property
    def stop(self) -> list[str]:
        return self.task.stop

    def reward_spec(self) -> dict[str, Any]:
        """The functions, their weights and the task's, and what the functions' ``answer``
        column holds (:data:`ANSWER_COLUMN`): anchors presampled when it held the gold alone
        have another key, so they are sampled again rather than reused under this reward."""
        return {
            "functions": self.functions,
            "weights": self.weights,
            "task_weight": self.task_weight,
            "answer": ANSWER_COLUMN,
        }

    def failures(self) -> dict[str, int]:
        """Reward-function calls that raised or timed out, per function."""
        return {name: v.failures + v.timeouts for name, v in self.verifiers.items()}

    def verifier_stats(self) -> dict[str, int]:
        """The task's own counts (its ``reward`` and ``correct``) plus the reward functions'."""
        stats = dict(self.task.verifier_stats())
        for key, value in sum_stats(*self.verifiers.values()).items():
            stats[key] = stats.get(key, 0) + value
        return stats


def with_rewards(
    task: Task,
    functions: Sequence[str | RewardFunction],
    weights: Sequence[float] | None,
    task_weight: float,
) -> Task:
    """``task`` itself when its reward is unchanged (no function, weight 1), else a
    :class:`RewardedTask` (``functions``: names, ``module:function`` strings or module-level
    functions)."""
    if not functions and task_weight == 1.0:
        return task
    return RewardedTask(task, functions, weights, task_weight)
