"""Row bookkeeping of token batches: left padding and its position ids, the cells of
right-padded rows' real tokens, and rows that repeat one another."""

from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids[B, L], mask[B, L])`` (CPU, long; mask 1 on real tokens)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, L]`` for a padding mask: each row counts its real tokens from 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def token_cells(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_of[N], t_of[N])``: the row and column of every real token of right-padded
    rows of these ``lengths``, row by row (``N = sum(lengths)``; CPU long tensors)."""
    row_of = torch.repeat_interleave(
        torch.arange(len(lengths)), torch.as_tensor(lengths, dtype=torch.long)
    )
    t_of = torch.cat([torch.arange(n) for n in lengths]) if lengths else row_of
    return row_of, t_of


def distinct_rows(keys: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """``(first, copy_of)`` for rows with these ``keys``: the first row of each distinct key,
    in order of appearance, and for every row the index of its key in ``first``."""
    index: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    copy_of = []
    for row, key in enumerate(keys):
        if key not in index:
            index[key] = len(first)
            first.append(row)
        copy_of.append(index[key])
    return first, copy_of
