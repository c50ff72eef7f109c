"""Tokenizer, tiny model factory, loading and scoring of Hugging Face causal LMs.

The public names below load lazily (PEP 562), so the command line (:mod:`anchor_rl.cli`)
does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_tokenizer": "tokenizer",
    "encode_prompt": "tokenizer",
    "SIZES": "factory",
    "build_model": "factory",
    "load_policy": "loading",
    "save_policy": "loading",
    "token_logprobs": "scoring",
    "train_sft": "sft",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
