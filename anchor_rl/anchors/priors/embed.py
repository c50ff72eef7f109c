"""Prompt embeddings for the ``knn`` prior: the policy's own mean-pooled last hidden state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@torch.no_grad()
def prompt_embeddings(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    batch_size: int = 32,
) -> Tensor:
    """Mean over prompt tokens of the model's last hidden state, ``[P, D]`` float32 on the CPU.

    Args:
        model: a Hugging Face model; its backbone ``model.base_model`` is run (no LM head).
        tokenizer: encodes ``prompts`` given as strings (``tokenizer(text)["input_ids"]``);
            unused, and may be ``None``, when ``prompts`` are token-id lists (pass the ids the
            trainer already encoded with the chat template to embed exactly what it samples).
        prompts: ``P`` strings or ``P`` lists of token ids.
        batch_size: prompts per forward pass.

    Prompts are right-padded within a batch; padding is masked out of attention and of the
    mean (causal attention keeps real positions unaffected). The model runs in eval mode
    (dropout off) and its previous mode is restored.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer")
            p = tokenizer(p)["input_ids"]
        ids.append([int(t) for t in p])
        if not ids[-1]:
            raise ValueError(f"prompt {i} encodes to no tokens")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size]
            width = max(len(x) for x in chunk)
            input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, x in enumerate(chunk):
                input_ids[row, : len(x)] = torch.tensor(x)
                mask[row, : len(x)] = 1
            input_ids, mask = input_ids.to(device), mask.to(device)
            hidden = model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            out.append(((hidden * m).sum(1) / m.sum(1)).float().cpu())
    finally:
        model.train(was_training)
    if not out:
        return torch.empty(0, model.config.hidden_size)
    return torch.cat(out)
