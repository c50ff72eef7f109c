"""DAPO's soft overlong punishment (arXiv 2503.14476)."""

from __future__ import annotations


def soft_punishment(length: int, max_len: int, cache_len: int) -> float:
    """Length penalty added to the reward of a response of ``length`` tokens.

    0 while ``length <= max_len - cache_len``; then linear, ``(max_len - cache_len -
    length) / cache_len``, reaching -1 at ``max_len``; -1 beyond ``max_len``.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    free = max_len - cache_len
    if length <= free:
        return 0.0
    if length > max_len:
        return -1.0
    return (free - length) / cache_len
