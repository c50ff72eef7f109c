"""Tiny Llama-architecture causal LMs built from a named size.

The sizes are chosen for CPU experiments with the built-in character-level tokenizer
(vocabulary 111): ``tiny`` is about 1M parameters, ``small`` 10M, ``base`` 50M. Input
and output embeddings are tied. Rotary position embeddings add no parameters, so the
context limit (1024 positions) is sized for the multi-turn tool tasks, not for cost.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

SIZES: dict[str, dict] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 512,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "intermediate_size": 1024,
    },
    "base": {
        "hidden_size": 512,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "intermediate_size": 2048,
    },
}
MAX_POSITIONS = 1024


def model_config(size: str, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The ``LlamaConfig`` of a named size, with the tokenizer's vocabulary and special ids."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    return llama_config(tokenizer, **SIZES[size])


def llama_config(tokenizer: PreTrainedTokenizerBase, **shape: int) -> LlamaConfig:
    """A ``LlamaConfig`` of the given shape (``hidden_size=...``, ``num_hidden_layers=...``)
    with the tokenizer's vocabulary and special ids, tied embeddings and the project's
    position limit."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )


def build_model(size: str, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised model of a named size; the same seed gives the same weights."""
    config = model_config(size, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct trainable parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
