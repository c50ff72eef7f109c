"""Left padding of token lists and the position ids that go with it."""

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
