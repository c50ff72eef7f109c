"""Saving and loading policies as Hugging Face model directories.

Any directory ``AutoModelForCausalLM`` and ``AutoTokenizer`` can read works: the
built-in tiny models are saved the same way as any other causal LM.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from anchor_rl.errors import AnchorRLError, ConfigError


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
    if not path.is_dir():
        raise AnchorRLError(f"model directory {path} does not exist")
    if why := _run_directory(path):
        raise AnchorRLError(why)
    if not (path / "config.json").is_file():
        raise AnchorRLError(f"{path} is not a model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise AnchorRLError(f"{path} holds no loadable tokenizer: {exc}") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise AnchorRLError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype)).to(device)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise AnchorRLError(
                f"{path} holds a model that is not a causal LM ({_model_type(path)}): "
                "AutoModelForCausalLM cannot load it"
            ) from None
        raise
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise AnchorRLError(
            f"the tokenizer in {path} has {len(tokenizer)} tokens but the model's embeddings "
            f"only {embeddings}: the tokenizer does not belong to this model"
        )
    return model, tokenizer


RUN_CONFIG_KEYS = frozenset({"task", "model", "rollout", "advantage", "steps"})
"""Keys of a training run's config.json (anchor_rl.trainer.config.TrainConfig) that a
Hugging Face model's config.json does not have together."""


def _run_directory(path: Path) -> str | None:
    """When ``path`` is an anchor-rl run directory (a config.json that is a run's config, not
    a model's, or checkpoints/step_* beside no model config): where its models are, naming
    the newest checkpoint's policy; None for any other directory."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    keys = set(config) if isinstance(config, dict) else set()
    saved = sorted(path.glob("checkpoints/step_*/policy"))
    if not keys >= RUN_CONFIG_KEYS and not (saved and "model_type" not in keys):
        return None
    where = f"the newest is {saved[-1]}" if saved else "it has no checkpoint yet"
    return (
        f"{path} is an anchor-rl run directory, not a model: give a checkpoint's policy, "
        f"{path / 'checkpoints' / 'step_NNNNNN' / 'policy'}; {where}"
    )


def _model_type(path: Path) -> str:
    try:
        return str(json.loads((path / "config.json").read_text()).get("model_type", "unknown"))
    except (OSError, ValueError):
        return "unreadable config.json"


def check_device(device: str) -> None:
    """ConfigError when ``device`` is no torch device; AnchorRLError when it names an
    accelerator this machine does not have."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"device={device!r} is not a torch device; use cpu, cuda, cuda:N or mps"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        built = "with" if torch.version.cuda else "without"
        raise AnchorRLError(
            f"device={device} but no CUDA GPU is visible (torch {torch.__version__} is built "
            f"{built} CUDA); use device=cpu"
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise AnchorRLError(f"device={device} but MPS is not available here; use device=cpu")


def save_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> Path:
    """Write model weights, config and tokenizer to ``path`` (created if missing)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
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


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' loading/saving bars (they would tear through the run's progress bar)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
