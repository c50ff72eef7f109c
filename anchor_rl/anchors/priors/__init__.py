"""Priors: predict each prompt's expected reward before sampling it (V0.5's ``V``).

* :class:`AnchorPrior` (``anchor``): PVPO's static per-prompt anchor.
* :class:`HistoryPrior` (``history``): per-prompt Beta posterior over the policy's own
  rollouts, with per-step forgetting, on top of a base prior.
* :class:`KNNPrior` (``knn``): in-context kernel neighbours over recent (embedding, outcome)
  pairs; embeddings from :func:`prompt_embeddings`.

Rewards and predictions are in the task's reward units; see :mod:`.base` for the range rules
and docs/v05.md for the knobs.
"""

from anchor_rl.anchors.priors.anchor import AnchorPrior
from anchor_rl.anchors.priors.base import Prior, RewardRange
from anchor_rl.anchors.priors.embed import prompt_embeddings
from anchor_rl.anchors.priors.history import HistoryPrior
from anchor_rl.anchors.priors.knn import KNNPrior
from anchor_rl.anchors.priors.metrics import (
    concordance_auc,
    ece,
    evaluate_prior,
    prior_metrics,
)

PRIORS: dict[str, type] = {"anchor": AnchorPrior, "history": HistoryPrior, "knn": KNNPrior}

__all__ = [
    "PRIORS",
    "AnchorPrior",
    "HistoryPrior",
    "KNNPrior",
    "Prior",
    "RewardRange",
    "concordance_auc",
    "ece",
    "evaluate_prior",
    "prior_metrics",
    "prompt_embeddings",
]
