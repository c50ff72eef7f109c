"""Generation engines (the :class:`~anchor_rl.rollout.engine.Engine` seam), the agent loop and
sampling-based evaluation.

The public names below load lazily (PEP 562), so the command line (:mod:`anchor_rl.cli`)
does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SamplingParams": "types",
    "Engine": "engine",
    "Request": "engine",
    "make_engine": "engine",
    "register_engine": "engine",
    "request_seed": "engine",
    "group_requests": "engine",
    "run_agent": "agent",
    "evaluate": "evaluate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
