"""Helpers of the LoRA tests (tests/ is on the path, tests/conftest.py): a LoRA policy on a
random-init model, a real update of its adapters, and the check that an engine samples with
the policy's adapters and not with its base model."""

from __future__ import annotations

import torch
from helpers import requests

from anchor_rl.models.lora import LoRAConfig, apply_lora, lora_base
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.rollout.types import SamplingParams

PROMPTS = ["1+2=", "3+4=", "5+6="]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)


def lora_policy(model: torch.nn.Module, rank: int = 4) -> torch.nn.Module:
    """``model`` with fresh rank-``rank`` adapters on every linear layer, seeded."""
    return apply_lora(model, LoRAConfig(rank=rank), seed=0)


def update_adapters(engine, policy: torch.nn.Module, steps: int = 3, lr: float = 0.05) -> None:
    """A few AdamW steps on the adapters that raise the log-probs of ``engine``'s samples
    (a real update: only the adapters have gradients)."""
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    batch = engine.rollout(requests(PROMPTS, n=2, seed=1), PARAMS)
    for _ in range(steps):
        loss = -(token_logprobs(policy, batch)[0] * batch.loss_mask).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def sampled_gaps(engine, policy: torch.nn.Module) -> tuple[float, float]:
    """Roll out through ``engine``; the largest gap of the engine's sampled-token log-probs to
    the LoRA policy's own scores, and to its base model's (the adapters disabled)."""
    batch = engine.rollout(requests(PROMPTS, n=4, seed=2), PARAMS)
    mask = batch.loss_mask
    with torch.no_grad():
        mine = token_logprobs(policy, batch)[0]
        base = token_logprobs(lora_base(policy), batch)[0]
    gap = lambda other: float(((batch.logprobs - other) * mask).abs().max())  # noqa: E731
    return gap(mine), gap(base)
