"""Helpers shared by the test packages (importable from every one of them: tests/ is on the
path because of tests/conftest.py): a toy task a random-init model earns reward on, the
tiny-run overrides, seeded engine requests, and a run's metrics without its timings."""

from __future__ import annotations

import math
from pathlib import Path

from anchor_rl.rollout.engine import Request, group_requests
from anchor_rl.tasks.base import Record, Task

TINY = [
    "model=random:tiny",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "eval.prompts=3",
    "eval.every=2",
    "log.progress=false",
]
"""Overrides that make any preset a run of a second or two on a random-init model."""


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


def requests(prompts: list[str], n: int = 1, seed: int = 0) -> list[Request]:
    """``n`` seeded requests per prompt (group i for prompts[i])."""
    return group_requests(prompts, list(range(len(prompts))), n, "test", seed)


def metrics_but_timings(run_dir: Path) -> list[dict]:
    """Every metric of every step of a run but its timings (NaN made comparable)."""
    from anchor_rl.trainer.logging import read_metrics

    return [
        {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()
         if not k.startswith("time/") and "seconds" not in k}
        for r in read_metrics(run_dir)
    ]  # fmt: skip
