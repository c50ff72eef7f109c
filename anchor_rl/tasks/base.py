"""The task contract: records with verifiable answers, a verifier and a reference trace.

A task is what the trainer, the presampler and the SFT warm start all read from. It is
deliberately small: anything that can produce :class:`Record` objects and score a
completion string against one is a task.

A verifier must not stall or crash a run: a completion is model output and may be
anything (megabytes, unbalanced braces, a 5,000-digit number, NUL, lone surrogates).
:class:`GuardedTask`, the base of every built-in task, runs ``reward`` and ``correct``
under a :class:`~anchor_rl.rewards.safe.SafeVerifier` (an exception scores 0.0 / not
solved and is counted) and :meth:`Task.verifier_stats` reports the counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from anchor_rl.rewards.safe import SafeVerifier
from anchor_rl.tools.base import Tool

Split = Literal["train", "test"]


@dataclass(frozen=True)
class Record:
    """One prompt with its gold answer.

    ``prompt`` is the user's question as plain text, without any chat formatting (the
    model side applies its chat template). ``answer`` is the gold answer as a string;
    ``meta`` holds task-specific extras (difficulty, operands, hops, ...), JSON-serialisable.
    """

    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """A source of records plus a verifier.

    Subclasses set ``name``, ``instruction`` (a short system instruction describing the
    output format, used when the model has a chat template) and ``tools`` (tool tag ->
    tool; empty for single-turn tasks), and may name ``scoring_kwargs``.
    """

    name: str = "task"
    instruction: str = "Answer inside <answer></answer>."
    tools: dict[str, Tool]
    scoring_kwargs: ClassVar[frozenset[str]] = frozenset()
    """Constructor arguments that change only how responses are scored, never the records
    or their reference traces: an SFT model ignores them, so one cached reference serves
    every choice of them."""

    def __init__(self) -> None:
        self.tools = {}

    @abstractmethod
    def records(self, split: Split) -> list[Record]:
        """All records of a split; train and test are disjoint and seeded."""

    @abstractmethod
    def reward(self, completion: str, record: Record) -> float:
        """The training reward of one completion (tool results included in the text)."""

    def correct(self, completion: str, record: Record) -> bool:
        """Whether a completion counts as solved for accuracy metrics."""
        return self.reward(completion, record) >= 1.0

    @abstractmethod
    def trace(self, record: Record) -> str:
        """A reference solution completion (what an oracle would write, tool turns included)."""

    def verifier_stats(self) -> dict[str, int]:
        """Cumulative counts of guarded verifier calls that went wrong, for a metrics logger.

        ``{"failures": n, "timeouts": m}``: calls whose verifier raised (scored as 0.0 or
        not solved) and calls that ran out of time (``TimeoutError``). Counts only grow.
        The default, for a task that guards nothing, is zeros; :class:`GuardedTask`
        counts its ``reward`` and ``correct`` calls (each is one guarded call).
        """
        return {"failures": 0, "timeouts": 0}

    def reward_spec(self) -> dict[str, Any] | None:
        """What replaced the task's own reward (``tasks.reward_set.RewardedTask``), for keys of
        anything computed with the reward; None: the task's reward as it is."""
        return None

    @property
    def stop(self) -> list[str]:
        """Strings that end one generation turn: the answer close tag and each tool's close tag."""
        return ["</answer>", *(f"</{tag}>" for tag in self.tools)]


def sum_stats(*guards: SafeVerifier) -> dict[str, int]:
    """``{"failures": ..., "timeouts": ...}`` summed over ``guards``."""
    totals = {"failures": 0, "timeouts": 0}
    for guard in guards:
        stats = guard.stats()
        totals["failures"] += stats["failures"]
        totals["timeouts"] += stats["timeouts"]
    return totals


class GuardedTask(Task):
    """A task whose ``reward`` and ``correct`` run under a :class:`SafeVerifier` each.

    Subclasses implement :meth:`score` (the reward, unguarded) and may override
    :meth:`verdict` (solved or not, unguarded; default ``score >= 1.0``). ``reward``
    returns ``score``, or 0.0 when it raises; ``correct`` returns ``verdict``, or False
    when it raises; either way the call is counted (a ``TimeoutError`` as a timeout) and
    the first few are logged, and :meth:`verifier_stats` sums both guards. ``correct`` is
    guarded too because it is the accuracy metric and PVPO's group-sampling input.

    The guards set no thread time limit: a thread cannot interrupt code that holds the
    GIL (regular-expression backtracking, a huge integer conversion), so verifiers must
    bound their own work: cap the inputs, parse in linear time, and run what cannot be
    bounded in a process with a deadline (as ``anchor_rl.rewards.math`` does).

    Attributes:
        reward_guard: the guard of ``reward`` (``stats()``, ``last_error``).
        correct_guard: the guard of ``correct``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reward_guard = SafeVerifier(self._score, on_error=0.0, name=f"{self.name}.reward")
        self.correct_guard = SafeVerifier(
            self._verdict, on_error=False, name=f"{self.name}.correct"
        )

    @abstractmethod
    def score(self, completion: str, record: Record) -> float:
        """The training reward of one completion, unguarded (``reward`` guards it)."""

    def verdict(self, completion: str, record: Record) -> bool:
        """Whether a completion counts as solved, unguarded (``correct`` guards it)."""
        return self.score(completion, record) >= 1.0

    def _score(self, completion: str, record: Record) -> float:
        return float(self.score(completion, record))

    def _verdict(self, completion: str, record: Record) -> bool:
        return bool(self.verdict(completion, record))

    def reward(self, completion: str, record: Record) -> float:
        """:meth:`score`, or 0.0 (counted) if it raises."""
        return self.reward_guard(completion, record)

    def correct(self, completion: str, record: Record) -> bool:
        """:meth:`verdict`, or False (counted) if it raises."""
        return self.correct_guard(completion, record)

    def verifier_stats(self) -> dict[str, int]:
        """Failures and timeouts of ``reward`` and ``correct`` calls, summed."""
        return sum_stats(self.reward_guard, self.correct_guard)
