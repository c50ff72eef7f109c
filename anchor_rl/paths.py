"""Where anchor-rl keeps what it caches: one place for every default path.

``$ANCHOR_RL_CACHE`` (default ``~/.cache/anchor-rl``) holds the SFT references, the value
pretraining cache and the shared anchor store.
"""

from __future__ import annotations

import os
from pathlib import Path

STORE_FILE = "anchors.db"
"""The shared anchor store's file name under the cache root."""


def cache_root() -> Path:
    """``$ANCHOR_RL_CACHE`` or ``~/.cache/anchor-rl``."""
    return Path(os.environ.get("ANCHOR_RL_CACHE", Path.home() / ".cache" / "anchor-rl"))


def store_path(store: str | Path | None) -> Path:
    """The anchor store a setting names: ``store``, or the shared ``cache_root() / anchors.db``."""
    return Path(store) if store else cache_root() / STORE_FILE
