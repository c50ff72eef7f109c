"""The ``knn`` prior: an in-context predictor over the policy's recent (prompt, outcome) pairs.

In the spirit of the generalist value model V0 (arXiv 2602.03584), whose context is the
current policy's history of prompts and outcomes: the context is a window of the most
recent ``(embedding, mean reward)`` pairs, and an unseen prompt is predicted from its
neighbours in embedding space.

Similarity is the cosine ``s_j`` between the query and context entry ``j``, after
subtracting the context's mean embedding from both when ``center`` is on (mean-pooled
hidden states of a language model share a large common direction, which otherwise makes
every prompt look alike). Only the ``top_k`` most similar entries with
``s_j > min_similarity`` count, weighted by the kernel ``w_j = exp((s_j - 1) / temperature)``
(1 for an identical direction). The prediction shrinks toward the context mean ``y_bar``
with a pseudo-weight ``shrink``::

    pred = (sum_j w_j * y_j + shrink * y_bar) / (sum_j w_j + shrink)

so weak or absent neighbours give the context mean. An empty context predicts ``default``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from anchor_rl.anchors.priors.base import RewardRange, check_range, rewards_per_prompt


class KNNPrior:
    """Kernel-weighted nearest neighbours over a sliding window of recent outcomes.

    Args:
        window: how many recent ``(embedding, outcome mean)`` pairs the context keeps (FIFO).
        top_k: neighbours used per prediction.
        temperature: kernel temperature; smaller trusts only very close neighbours.
        min_similarity: entries with cosine similarity ``<=`` this are not neighbours.
        shrink: pseudo-weight of the context mean (``>= 0``; 0 disables shrinkage, then a
            prompt without neighbours still gets the context mean).
        center: subtract the context's mean embedding before the cosine.
        default: prediction while the context is empty; ``None`` = middle of the reward range.
        reward_range: the task's ``(lo, hi)``.
    """

    name = "knn"

    def __init__(
        self,
        window: int = 256,
        top_k: int = 16,
        temperature: float = 0.1,
        min_similarity: float = 0.0,
        shrink: float = 1.0,
        center: bool = True,
        default: float | None = None,
        reward_range: RewardRange = (0.0, 1.0),
    ) -> None:
        self.reward_range = check_range(reward_range)
        lo, hi = self.reward_range
        if window < 1 or top_k < 1:
            raise ValueError(f"window and top_k must be >= 1, got {window}, {top_k}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not shrink >= 0:
            raise ValueError(f"shrink must be >= 0, got {shrink}")
        default = (lo + hi) / 2 if default is None else float(default)
        if not lo <= default <= hi:
            raise ValueError(f"default {default} outside the reward range [{lo}, {hi}]")
        self.window = window
        self.top_k = top_k
        self.temperature = float(temperature)
        self.min_similarity = float(min_similarity)
        self.shrink = float(shrink)
        self.center = center
        self.default = default
        self.keys = torch.empty(0, 0)  # [N, D] embeddings as given, oldest first
        self.values = torch.empty(0)  # [N] outcome means in reward units

    def __len__(self) -> int:
        return self.values.numel()

    def _embeddings(self, prompt_ids: Sequence[str], embeddings: Tensor | None) -> Tensor:
        """Validated ``[P, D]`` float32 CPU copy of ``embeddings``."""
        if embeddings is None:
            raise ValueError("the knn prior needs prompt embeddings [P, D]")
        if embeddings.dim() != 2 or embeddings.shape[0] != len(prompt_ids):
            raise ValueError(
                f"embeddings must be [P, D] with P = {len(prompt_ids)}, "
                f"got shape {tuple(embeddings.shape)}"
            )
        if len(self) and embeddings.shape[1] != self.keys.shape[1]:
            raise ValueError(
                f"embedding size {embeddings.shape[1]} differs from the context's "
                f"{self.keys.shape[1]}"
            )
        return embeddings.detach().to("cpu", torch.float32)

    def predict(self, prompt_ids: Sequence[str], embeddings: Tensor | None = None) -> Tensor:
        """Predicted mean reward ``[P]`` (float32) from ``embeddings[P, D]``."""
        query = self._embeddings(prompt_ids, embeddings)
        if len(self) == 0:
            return torch.full((len(prompt_ids),), self.default, dtype=torch.float32)
        offset = self.keys.mean(0) if self.center else torch.zeros(self.keys.shape[1])
        keys = F.normalize(self.keys - offset, dim=-1)
        query = F.normalize(query - offset, dim=-1)
        sim, idx = (query @ keys.T).topk(min(self.top_k, len(self)), dim=-1)  # [P, k]
        # log-weights, normalised by a softmax so tiny kernel values do not underflow
        logit = torch.where(sim > self.min_similarity, (sim - 1.0) / self.temperature, -torch.inf)
        log_shrink = math.log(self.shrink) if self.shrink > 0 else -math.inf
        logit = torch.cat([logit, torch.full_like(logit[:, :1], log_shrink)], dim=-1)
        mean = self.values.mean()
        target = torch.cat([self.values[idx], mean.expand(len(idx), 1)], dim=-1)
        pred = (logit.softmax(-1) * target).sum(-1)
        no_weight = torch.isinf(logit).all(-1)  # no neighbour and no shrinkage
        return torch.where(no_weight, mean, pred)

    def update(
        self,
        prompt_ids: Sequence[str],
        rewards: Sequence[Tensor],
        embeddings: Tensor | None = None,
    ) -> None:
        """Append one ``(embedding, mean reward)`` pair per prompt; keep the last ``window``."""
        keys = self._embeddings(prompt_ids, embeddings)
        groups = rewards_per_prompt(prompt_ids, rewards, self.reward_range)
        if not groups:
            return
        values = torch.stack([r.mean() for r in groups]).to(torch.float32)
        self.keys = (torch.cat([self.keys, keys]) if len(self) else keys)[-self.window :]
        self.values = torch.cat([self.values, values])[-self.window :]

    def state_dict(self) -> dict[str, Any]:
        """The context: embeddings ``keys[N, D]`` and outcome means ``values[N]``."""
        return {"keys": self.keys.clone(), "values": self.values.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the context of :meth:`state_dict`."""
        self.keys, self.values = state["keys"].clone(), state["values"].clone()
