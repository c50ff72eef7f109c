"""The prior interface and the reward-range helpers every prior shares.

A prior predicts each prompt's expected reward before (or without) sampling it, and learns
from the rewards observed afterwards. Shapes: ``P`` prompts, ``D`` embedding size.

Reward range: every prior is built for a task's reward range ``(lo, hi)`` (``(0, 1)`` for
{0,1} or fractional rewards, ``(-1, 1)`` for the +-1 rewards of the V0.5 paper).
``predict`` returns expected rewards in those units and ``update`` takes rewards in those
units; a reward outside ``[lo, hi]`` is an error, never clipped. Internally the ``history``
prior maps rewards to ``u = (r - lo) / (hi - lo)`` in ``[0, 1]`` and treats ``u`` as a
(fractional) success.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

RewardRange = tuple[float, float]


@runtime_checkable
class Prior(Protocol):
    """What the trainer and the V0.5 fusion need from a prior."""

    name: str
    reward_range: RewardRange

    def predict(self, prompt_ids: Sequence[str], embeddings: Tensor | None = None) -> Tensor:
        """Expected reward ``[P]`` (float32, reward units) of each prompt under the current policy.

        ``embeddings[P, D]`` is required by priors that generalise across prompts (``knn``).
        """
        ...

    def update(
        self,
        prompt_ids: Sequence[str],
        rewards: Sequence[Tensor],
        embeddings: Tensor | None = None,
    ) -> None:
        """Record observed rewards: ``rewards[i]`` is the 1-D tensor of rollout rewards of
        ``prompt_ids[i]`` (any number >= 1). Call it once per training step with all of that
        step's prompts (the ``history`` prior's forgetting counts calls)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the prior has learned, as plain data and tensors (for checkpoints)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned into a prior built with the same settings."""
        ...


def check_range(reward_range: RewardRange) -> RewardRange:
    """Validate ``(lo, hi)`` with ``lo < hi`` and return it as floats."""
    lo, hi = (float(x) for x in reward_range)
    if not lo < hi:
        raise ValueError(f"reward_range must be (lo, hi) with lo < hi, got {reward_range}")
    return lo, hi


def rewards_per_prompt(
    prompt_ids: Sequence[str], rewards: Sequence[Tensor], reward_range: RewardRange
) -> list[Tensor]:
    """Validate ``update`` arguments; return the rewards as 1-D float64 tensors.

    Raises ``ValueError`` naming the prompt when a group is empty or a reward lies outside
    ``reward_range``.
    """
    if len(prompt_ids) != len(rewards):
        raise ValueError(
            f"got {len(prompt_ids)} prompt ids but {len(rewards)} reward groups; "
            "rewards[i] must hold the rollout rewards of prompt_ids[i]"
        )
    lo, hi = reward_range
    out = []
    for pid, r in zip(prompt_ids, rewards, strict=True):
        r = torch.as_tensor(r, dtype=torch.float64).reshape(-1)
        if r.numel() == 0:
            raise ValueError(f"prompt {pid!r}: empty reward group")
        if bool(((r < lo) | (r > hi) | r.isnan()).any()):
            raise ValueError(
                f"prompt {pid!r}: rewards {r.tolist()} fall outside the prior's reward range "
                f"[{lo}, {hi}]"
            )
        out.append(r)
    return out
