"""The ``anchor`` prior: PVPO's static anchor, a fixed mean reward per prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from anchor_rl.anchors.priors.base import RewardRange, check_range


class AnchorPrior:
    """A fixed mapping ``prompt id -> mean reward`` (PVPO's ``V_sta``), measured before training.

    Args:
        anchors: prompt id -> mean reward of the reference rollouts, in reward units. Any
            mapping works (e.g. built from the anchor store's per-prompt means).
        reward_range: the task's ``(lo, hi)``; every anchor must lie inside it.
        default: the prediction for a prompt missing from ``anchors``. ``None`` (the default)
            uses the mean of all anchor values (the global mean); an empty ``anchors`` then
            needs an explicit ``default``.

    The anchor is static by definition: :meth:`update` records nothing. PVPO refreshes it
    every K steps by re-presampling; build a new ``AnchorPrior`` from the refreshed store.
    """

    name = "anchor"

    def __init__(
        self,
        anchors: Mapping[str, float],
        reward_range: RewardRange = (0.0, 1.0),
        default: float | None = None,
    ) -> None:
        self.reward_range = check_range(reward_range)
        lo, hi = self.reward_range
        self.anchors = {str(k): float(v) for k, v in anchors.items()}
        bad = {k: v for k, v in self.anchors.items() if not lo <= v <= hi}
        if bad:
            shown = dict(list(bad.items())[:5])
            raise ValueError(f"anchors outside the reward range [{lo}, {hi}]: {shown}")
        if default is None:
            if not self.anchors:
                raise ValueError("an empty anchor mapping needs an explicit default")
            default = sum(self.anchors.values()) / len(self.anchors)
        if not lo <= default <= hi:
            raise ValueError(f"default {default} outside the reward range [{lo}, {hi}]")
        self.default = float(default)

    def predict(self, prompt_ids: Sequence[str], embeddings: Tensor | None = None) -> Tensor:
        """The anchor of each prompt ``[P]`` (``default`` for unknown ids); embeddings unused."""
        values = [self.anchors.get(str(pid), self.default) for pid in prompt_ids]
        return torch.tensor(values, dtype=torch.float32)

    def update(
        self,
        prompt_ids: Sequence[str],
        rewards: Sequence[Tensor],
        embeddings: Tensor | None = None,
    ) -> None:
        """Static prior: observed rewards do not move the anchor (see the class docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the anchors are set at construction and never learn."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`)."""
