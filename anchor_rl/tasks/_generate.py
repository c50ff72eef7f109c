"""Seeded generation of unique records split into disjoint test and train sets."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from anchor_rl.tasks.base import Record, Split

T = TypeVar("T")

Draw = tuple[str, str, dict[str, Any]]


def check_counts(n_train: int, n_test: int) -> None:
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train}, {n_test}")


def mix(options: Sequence[T], weights: Sequence[float] | None, what: str) -> list[float]:
    """Validated sampling weights for ``options`` (uniform when None)."""
    if not options:
        raise ValueError(f"no {what} given")
    if weights is None:
        return [1.0] * len(options)
    if len(weights) != len(options) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"{what} weights must be {len(options)} non-negative numbers with a positive sum, "
            f"got {list(weights)}"
        )
    return [float(w) for w in weights]


def unique_splits(
    name: str,
    seed: int,
    n_train: int,
    n_test: int,
    draw: Callable[[random.Random], Draw],
    max_attempts_per_record: int = 50,
) -> dict[Split, list[Record]]:
    """``n_test`` then ``n_train`` records with distinct prompts, from one seeded stream.

    The test split is drawn first, so it depends only on the seed, the generator and
    ``n_test`` (growing ``n_train`` leaves it unchanged). Ids are ``{name}-{split}-{i}``.
    """
    rng = random.Random(seed)
    wanted = n_test + n_train
    seen: set[str] = set()
    draws: list[Draw] = []
    for _ in range(max_attempts_per_record * max(wanted, 1)):
        if len(draws) == wanted:
            break
        prompt, answer, meta = draw(rng)
        if prompt not in seen:
            seen.add(prompt)
            draws.append((prompt, answer, meta))
    if len(draws) < wanted:
        raise ValueError(
            f"{name}: found only {len(draws)} distinct prompts of the {wanted} requested; "
            "ask for fewer records or allow harder levels"
        )
    records = [
        Record(f"{name}-{split}-{i}", prompt, answer, meta)
        for split, chunk in (("test", draws[:n_test]), ("train", draws[n_test:]))
        for i, (prompt, answer, meta) in enumerate(chunk)
    ]
    return {
        "test": records[:n_test],
        "train": records[n_test:],
    }
