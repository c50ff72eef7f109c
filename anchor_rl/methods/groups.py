"""Group bookkeeping every host shares: which rows belong to which prompt.

Shapes: B responses (rows), G prompts (groups), ``group[B]`` int64 in ``0..G-1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def group_index(keys: Sequence[Any]) -> tuple[Tensor, list[str]]:
    """``(group[B] int64, keys[G])``: each row's group id, groups in order of first appearance
    of their key (``str(key)``)."""
    order: dict[str, int] = {}
    group = [order.setdefault(str(k), len(order)) for k in keys]
    return torch.tensor(group, dtype=torch.long), list(order)


def first_rows(group: Tensor, groups: int) -> list[int]:
    """Index of the first row of each group ``0..G-1`` in ``group[B]``."""
    first: dict[int, int] = {}
    for row, g in enumerate(group.tolist()):
        first.setdefault(g, row)
    return [first[g] for g in range(groups)]


def last_rows(group: Tensor, groups: Sequence[int]) -> list[int]:
    """Index of the last row of each group in ``groups`` (ids in ``group[B]``)."""
    return [int((group == g).nonzero()[-1]) for g in groups]
