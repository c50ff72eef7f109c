"""The task contract: records with verifiable answers, a verifier and a reference trace.

A task is what the trainer, the presampler and the SFT warm start all read from. It is
deliberately small: anything that can produce :class:`Record` objects and score a
completion string against one is a task.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

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
    tool; empty for single-turn tasks).
    """

    name: str = "task"
    instruction: str = "Answer inside <answer></answer>."
    tools: dict[str, Tool]

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

    def reward_spec(self) -> dict[str, Any] | None:
        """What replaced the task's own reward (``tasks.reward_set.RewardedTask``), for keys of
        anything computed with the reward; None: the task's reward as it is."""
        return None

    @property
    def stop(self) -> list[str]:
        """Strings that end one generation turn: the answer close tag and each tool's close tag."""
        return ["</answer>", *(f"</{tag}>" for tag in self.tools)]
