"""Saving and loading policies as Hugging Face model directories.

Any directory ``AutoModelForCausalLM`` and ``AutoTokenizer`` can read works: the
built-in tiny models are saved the same way as any other causal LM.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16'")
    return resolved


def load_policy(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a Hugging Face causal-LM directory.

    ``dtype=None`` keeps the dtype the weights were saved in. A tokenizer without a pad
    token gets its eos token as pad (pad positions are always masked, so this only
    names an id to fill with).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype)).to(device)
    return model, tokenizer


def save_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> Path:
    """Write model weights, config and tokenizer to ``path`` (created if missing)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn every dropout in ``model`` off, in place; returns how many were on.

    Sets ``p = 0`` on ``nn.Dropout`` modules and zeroes the float dropout rates that
    attention layers keep as attributes (Llama's and Qwen's ``attention_dropout``, read at
    forward time in training mode). The model's saved config is left as it is.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                changed += 1
    return changed
