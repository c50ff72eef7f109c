"""The ``history`` prior: a per-prompt Beta posterior over the policy's own past rollouts.

Rewards are mapped to ``u = (r - lo) / (hi - lo)`` in ``[0, 1]``; a rollout adds ``u`` to the
success pseudo-count ``a`` and ``1 - u`` to the failure pseudo-count ``b`` (the usual
Bernoulli update for {0,1} rewards, its fractional extension otherwise). The posterior of a
prompt with base-prior mean ``m0`` (normalised) is::

    Beta(strength * m0 + a, strength * (1 - m0) + b)   ->   mean (strength * m0 + a) / (strength + a + b)

Forgetting is per training step: every :meth:`HistoryPrior.update` call is one step, and
evidence observed ``t`` steps ago counts ``gamma ** t`` of its weight (applied lazily, so a
prompt not seen for a long time drifts back to its base prior). A per-step clock follows
the policy's optimisation rather than how often a prompt happens to be drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from anchor_rl.anchors.priors.base import Prior, RewardRange, check_range, rewards_per_prompt


class HistoryPrior:
    """Per-prompt Beta posterior with exponential forgetting, layered on a base prior.

    Args:
        base: the prior whose prediction is the Beta prior's mean (e.g. an ``AnchorPrior``);
            ``None`` means the middle of the reward range. It must share ``reward_range``.
            :meth:`update` forwards every update to it, so hold one composed prior.
        strength: pseudo-count weight of the base prior (in rollouts), ``> 0``.
        gamma: per-step forgetting factor in ``(0, 1]``; 1 keeps all evidence.
        reward_range: the task's ``(lo, hi)``.
    """

    name = "history"

    def __init__(
        self,
        base: Prior | None = None,
        strength: float = 4.0,
        gamma: float = 0.95,
        reward_range: RewardRange = (0.0, 1.0),
    ) -> None:
        self.reward_range = check_range(reward_range)
        if base is not None and check_range(base.reward_range) != self.reward_range:
            raise ValueError(
                f"base prior {base.name!r} has reward range {base.reward_range}, "
                f"this prior {self.reward_range}"
            )
        if not strength > 0:
            raise ValueError(f"strength must be > 0, got {strength}")
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.base = base
        self.strength = float(strength)
        self.gamma = float(gamma)
        self.step = 0
        # prompt id -> (success pseudo-count, failure pseudo-count, step of the last update)
        self._evidence: dict[str, tuple[float, float, int]] = {}

    def _counts(self, pid: str) -> tuple[float, float]:
        a, b, seen = self._evidence.get(pid, (0.0, 0.0, self.step))
        decay = self.gamma ** (self.step - seen)
        return a * decay, b * decay

    def _base_mean(self, prompt_ids: Sequence[str], embeddings: Tensor | None) -> Tensor:
        """Base prior mean ``[P]`` normalised to ``[0, 1]`` (float64)."""
        if self.base is None:
            return torch.full((len(prompt_ids),), 0.5, dtype=torch.float64)
        lo, hi = self.reward_range
        return (self.base.predict(prompt_ids, embeddings).to(torch.float64) - lo) / (hi - lo)

    def posterior(
        self, prompt_ids: Sequence[str], embeddings: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Beta parameters ``(alpha[P], beta[P])`` (float64) of each prompt's normalised success."""
        m0 = self._base_mean(prompt_ids, embeddings)
        counts = torch.tensor([self._counts(str(pid)) for pid in prompt_ids], dtype=torch.float64)
        counts = counts.reshape(len(prompt_ids), 2)
        alpha = self.strength * m0 + counts[:, 0]
        beta = self.strength * (1.0 - m0) + counts[:, 1]
        return alpha, beta

    def predict(self, prompt_ids: Sequence[str], embeddings: Tensor | None = None) -> Tensor:
        """Posterior mean reward ``[P]`` (float32, reward units); ``embeddings`` go to the base."""
        alpha, beta = self.posterior(prompt_ids, embeddings)
        lo, hi = self.reward_range
        return (lo + (hi - lo) * alpha / (alpha + beta)).to(torch.float32)

    def update(
        self,
        prompt_ids: Sequence[str],
        rewards: Sequence[Tensor],
        embeddings: Tensor | None = None,
        *,
        advance: bool = True,
    ) -> None:
        """Advance the clock one step, then add each prompt's rollouts to its discounted counts.

        A prompt id repeated within one call has its groups added in order. ``advance=False``
        keeps the clock: the rollouts belong to the step the last update began (a trainer that
        learns one step's rollouts in several batches), undiscounted against it.
        """
        groups = rewards_per_prompt(prompt_ids, rewards, self.reward_range)
        lo, hi = self.reward_range
        self.step += int(advance)
        for pid, r in zip(prompt_ids, groups, strict=True):
            pid = str(pid)
            a, b = self._counts(pid)
            u = (r - lo) / (hi - lo)
            self._evidence[pid] = (a + float(u.sum()), b + float((1.0 - u).sum()), self.step)
        if self.base is not None:
            self.base.update(prompt_ids, rewards, embeddings)

    def state_dict(self) -> dict[str, Any]:
        """The clock, each prompt's discounted counts and the base prior's state."""
        return {
            "step": self.step,
            "evidence": {pid: list(v) for pid, v in self._evidence.items()},
            "base": None if self.base is None else self.base.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the base prior's too)."""
        self.step = int(state["step"])
        self._evidence = {
            pid: (float(a), float(b), int(seen)) for pid, (a, b, seen) in state["evidence"].items()
        }
        if self.base is not None:
            self.base.load_state_dict(state["base"])
