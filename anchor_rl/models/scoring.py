"""Log-probs and entropies of response tokens under a causal LM.

The prompt is left-padded and the response right-padded, then the two are concatenated:
``[pad.. prompt | response ..pad]``, so every response starts at the same column and the
logits that predict it are the last ``T + 1`` positions but one. Position ids count
real tokens only, so a row's positions do not depend on how much padding it got.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from anchor_rl.batch import RolloutBatch


def entropy_from_logp(logp: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum p log p`` over the last axis of normalised log-probs ``[..., V]``.

    Works from ``log_softmax`` output, so large logits never overflow; ``-inf`` entries
    (masked tokens) contribute 0, in value and in gradient.
    """
    finite = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * finite).sum(-1)


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


def pack_prompt_response(
    batch: RolloutBatch, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids[B, L], mask[B, L], positions[B, L])`` of ``[pad.. prompt | response ..pad]`` on
    ``device`` (long tensors; L = longest prompt + T).

    The last ``T + 1`` columns but one end the states that predict the ``T`` response
    tokens: column ``L - T - 1 + t`` ends ``prompt + response[:t]``.
    """
    prompt_ids, prompt_mask = left_pad(batch.prompt_ids, batch.pad_id)
    ids = torch.cat([prompt_ids.to(device), batch.response_ids.to(device)], dim=1)
    mask = torch.cat([prompt_mask.to(device), batch.attention_mask.to(device).long()], dim=1)
    return ids, mask, position_ids(mask)


def _score(
    model: PreTrainedModel, batch: RolloutBatch, with_entropy: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = model.device
    ids, mask, positions = pack_prompt_response(batch, device)
    response_mask = batch.attention_mask.to(device)
    t = batch.response_ids.shape[1]
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=False,
        logits_to_keep=t + 1,
    ).logits[:, :-1, :]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids.to(device)[..., None]).squeeze(-1) * response_mask
    entropy = entropy_from_logp(logp_all) * response_mask if with_entropy else None
    return logp, entropy


def token_logprobs(
    model: PreTrainedModel,
    batch: RolloutBatch,
    with_entropy: bool = False,
    micro_batch: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``batch.response_ids`` given the prompts: ``(logp[B, T], entropy[B, T] | None)``.

    Both are 0 where ``batch.attention_mask`` is 0 and live on the model's device.
    Gradients flow when called with grad enabled. ``micro_batch`` bounds the rows per
    forward pass (the ``[rows, T, V]`` logits are the memory peak). ``temperature``
    divides the logits first (1.0: the model's own distribution).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    b = len(batch)
    step = micro_batch or b
    chunks = (
        [batch]
        if step >= b
        else [batch.select(range(i, min(i + step, b))) for i in range(0, b, step)]
    )
    parts = [_score(model, chunk, with_entropy, temperature) for chunk in chunks]
    logp = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return logp, entropy
