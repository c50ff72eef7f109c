"""Wall-clock accounting for the stages of a step."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

STEP_STAGES = ("generate", "score", "update", "sync")
"""The timed stages of a training step, logged as ``time/<stage>``: sampling (V0.5 top-ups
and dynamic-sampling rounds included), rewards, the update (log-probs, advantage,
optimizer steps) and pushing the new weights to the rollout engine."""


class Timer:
    """Sums the seconds spent in named sections: ``with timer("generate"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
