"""A toy task a random-init model earns reward on, so tiny runs have non-zero gradients
(imported by the trainer tests and by scripts/fingerprint_presets.py)."""

from __future__ import annotations

from anchor_rl.tasks.base import Record, Task


class ParityTask(Task):
    """Reward 1 when the completion's first character has an even code point.

    A random-init model gets it right about half the time, so groups of a few responses
    are mixed and all-equal about equally often (what dynamic sampling filters).
    """

    name = "parity"

    def records(self, split):
        offset = 0 if split == "train" else 100
        return [Record(f"{split}-{i}", f"q{i + offset}", "even") for i in range(8)]

    def reward(self, completion, record):
        return float(bool(completion) and ord(completion[0]) % 2 == 0)

    def trace(self, record):
        return "0"
