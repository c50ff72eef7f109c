"""The loop's counters: everything besides weights, RNG states and components that a
resumed run needs (components keep their own state, see ``component.Component``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Steps, the data cursor and the policy's cumulative counts."""

    step: int = 0
    """Steps completed."""
    consumed: int = 0
    """Prompts drawn from the prompt stream (the data cursor)."""
    rollouts: int = 0
    """Responses the policy generated so far, filtered ones and top-ups included."""
    tokens: int = 0
    """Policy tokens generated so far, filtered ones included."""
    discarded: int = 0
    """Responses sampled ahead for asynchronous steps and never used (the prompt stream moved
    past them): a cost, counted in ``rollouts/total``."""
    elapsed: float = 0.0
    """Wall-clock seconds spent in completed steps, evaluation and checkpoints."""
