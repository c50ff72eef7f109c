"""Sampling parameters of a rollout (the batch type it returns is :class:`anchor_rl.batch.RolloutBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    temperature: logits are divided by it; 0 means greedy decoding.
    top_p: nucleus sampling mass (1.0 keeps the full distribution).
    max_new_tokens: bound on the whole response, tool results included.
    max_turns: most tool calls executed per response (a tool call beyond it ends the
        response without a result).
    stop: strings that end a generation turn (besides eos); a tool's close tag is added
        automatically when tools are given.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    max_turns: int = 4
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0, got {self.max_turns}")
