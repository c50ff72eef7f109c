"""Whether an engine samples with a LoRA policy's adapters, or with its base model.

The failure this checks for: a LoRA policy whose sampler keeps the base weights (or the
weights before the last update) while the learner trains the adapters, so every rollout is
scored against a distribution it was not drawn from. The check rolls out through an engine,
scores the sampled tokens with the policy (adapters applied) and with its base model
(adapters taken out, :func:`anchor_rl.models.lora.lora_base`), and compares both to the
log-probs the engine reported: after an update and the loop's sync
(``engine.sync_weights(sampling_state(policy))``), the engine's must be the policy's.

Used by the LoRA tests (in-process, ``http`` and Ray engines) and by
``benchmarks/lora_sampler_check.py`` (the same check on a GPU). Everything is
device-correct: a batch is scored on the policy's device.
"""

from __future__ import annotations

from typing import Any

import torch

from anchor_rl.models.lora import LoRAConfig, apply_lora, lora_base
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.rollout.engine import Request, group_requests
from anchor_rl.rollout.types import SamplingParams

PROMPTS = ["1+2=", "3+4=", "5+6="]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)
STREAM = "lora-check"


def check_requests(n: int, seed: int) -> list[Request]:
    """``n`` requests per prompt of :data:`PROMPTS`, seeded by ``seed`` (group i: prompt i)."""
    return group_requests(PROMPTS, list(range(len(PROMPTS))), n, STREAM, seed)


def lora_policy(model: torch.nn.Module, rank: int = 4) -> torch.nn.Module:
    """``model`` with fresh rank-``rank`` adapters on every linear layer (A seeded by 0, B
    zero: it samples as its base model until an update)."""
    return apply_lora(model, LoRAConfig(rank=rank), seed=0)


def _device(policy: torch.nn.Module) -> torch.device:
    return next(policy.parameters()).device


def update_adapters(engine: Any, policy: torch.nn.Module, steps: int = 3, lr: float = 0.05) -> None:
    """``steps`` AdamW steps on the adapters of ``policy`` that raise the log-probs of
    ``engine``'s samples (6 responses of :data:`PARAMS`): a real update, only the adapters
    have gradients. The engine is not synced here."""
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    batch = engine.rollout(check_requests(n=2, seed=1), PARAMS).to(_device(policy))
    for _ in range(steps):
        loss = -(token_logprobs(policy, batch)[0] * batch.loss_mask).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def sampled_gaps(engine: Any, policy: torch.nn.Module) -> tuple[float, float]:
    """Roll out 12 responses through ``engine``; ``(to_policy, to_base)``: the largest
    absolute gap, over the sampled tokens, between the engine's log-probs (``logprobs[B, T]``)
    and the LoRA policy's own scores of them, and its base model's (adapters out)."""
    batch = engine.rollout(check_requests(n=4, seed=2), PARAMS).to(_device(policy))
    mask = batch.loss_mask
    with torch.no_grad():
        mine = token_logprobs(policy, batch)[0]
        base = token_logprobs(lora_base(policy), batch)[0]

    def gap(other: torch.Tensor) -> float:
        return float(((batch.logprobs - other) * mask).abs().max())

    return gap(mine), gap(base)
