"""How good is a prior: ranking (AUC) and calibration (ECE, MSE) against ground truth.

All metrics are in normalised units: predictions and truths are mapped from the reward
range ``(lo, hi)`` to ``[0, 1]`` first, so figures compare across tasks and reward forms.

* ``auc`` (pairwise, a concordance index): over all pairs of prompts whose true values
  differ, the probability that the prompt with the higher true value has the higher
  prediction; tied predictions count 1/2. Perfect ranking 1, reversed 0, constant
  prediction 0.5. For 0/1 truths this is the ordinary ROC AUC (Mann-Whitney). NaN when all
  true values are equal (no pair to rank).
* ``auc_rollout`` (only with ``outcomes``): the same concordance with every rollout as an
  item, scored by its prompt's prediction and labelled by its own reward. For 0/1 rewards
  this is the ROC AUC of the prior as a predictor of each rollout's success.
* ``ece``: equal-width bins over the prediction in ``[0, 1]`` (the last bin closed);
  ``sum_b n_b / P * |mean pred_b - mean true_b|``.
* ``mse``: ``mean (pred - true)^2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from anchor_rl.anchors.priors.base import Prior, RewardRange, check_range


def concordance_auc(score: Tensor, target: Tensor, chunk: int = 2048) -> float:
    """Pairwise AUC of ``score[N]`` against ``target[N]`` (see the module docstring).

    O(N^2) comparisons, done ``chunk`` rows at a time to bound memory.
    """
    score, target = score.reshape(-1).double(), target.reshape(-1).double()
    if score.shape != target.shape:
        raise ValueError(f"score and target sizes differ: {score.numel()} vs {target.numel()}")
    credit = 0.0
    pairs = 0
    for start in range(0, score.numel(), chunk):
        s, t = score[start : start + chunk, None], target[start : start + chunk, None]
        above = t > target[None, :]  # row's truth higher than column's
        credit += float(((s > score[None, :]) & above).sum())
        credit += 0.5 * float(((s == score[None, :]) & above).sum())
        pairs += int(above.sum())
    return credit / pairs if pairs else float("nan")


def ece(pred: Tensor, true: Tensor, bins: int = 10) -> float:
    """Expected calibration error of ``pred[P]`` in ``[0, 1]`` against ``true[P]``."""
    pred, true = pred.reshape(-1).double(), true.reshape(-1).double()
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if pred.numel() == 0:
        raise ValueError("ece needs at least one prediction")
    which = (pred * bins).floor().clamp(0, bins - 1).long()
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, pred - true)
    return float(gap.abs().sum() / pred.numel())


def prior_metrics(
    pred: Tensor,
    true: Tensor,
    outcomes: Sequence[Tensor] | None = None,
    reward_range: RewardRange = (0.0, 1.0),
    bins: int = 10,
) -> dict[str, float]:
    """AUC, ECE and MSE of predictions ``pred[P]`` against true mean rewards ``true[P]``.

    Args:
        pred, true: reward units (``true`` is e.g. the mean of 32 rollouts per prompt).
        outcomes: optional per-prompt rollout rewards (``outcomes[i]`` 1-D) for ``auc_rollout``.
        reward_range: the task's ``(lo, hi)``, used to normalise to ``[0, 1]``.
        bins: ECE bins.

    Returns:
        ``{"n", "auc", "ece", "mse"}`` plus ``"auc_rollout"`` when ``outcomes`` are given.
    """
    lo, hi = check_range(reward_range)
    pred = (pred.reshape(-1).double() - lo) / (hi - lo)
    true = (true.reshape(-1).double() - lo) / (hi - lo)
    if pred.shape != true.shape:
        raise ValueError(f"pred has {pred.numel()} prompts, true has {true.numel()}")
    out = {
        "n": float(pred.numel()),
        "auc": concordance_auc(pred, true),
        "ece": ece(pred, true, bins),
        "mse": float((pred - true).square().mean()),
    }
    if outcomes is not None:
        if len(outcomes) != pred.numel():
            raise ValueError(f"outcomes has {len(outcomes)} groups for {pred.numel()} prompts")
        groups = [torch.as_tensor(o, dtype=torch.float64).reshape(-1) for o in outcomes]
        sizes = torch.tensor([g.numel() for g in groups])
        out["auc_rollout"] = concordance_auc(pred.repeat_interleave(sizes), torch.cat(groups))
    return out


def evaluate_prior(
    prior: Prior,
    prompt_ids: Sequence[str],
    true: Tensor,
    embeddings: Tensor | None = None,
    outcomes: Sequence[Tensor] | None = None,
    bins: int = 10,
) -> dict[str, float]:
    """Score ``prior`` on held-out prompts: :func:`prior_metrics` of its predictions.

    ``true[P]`` holds the prompts' ground-truth mean rewards (e.g. 32 rollouts each) in the
    prior's reward units; ``embeddings[P, D]`` is needed by the ``knn`` prior. Adds
    ``pred_mean`` and ``true_mean`` (normalised) to the metrics.
    """
    pred = prior.predict(prompt_ids, embeddings)
    out = prior_metrics(pred, true, outcomes, prior.reward_range, bins)
    lo, hi = prior.reward_range
    out["pred_mean"] = float((pred.double().mean() - lo) / (hi - lo))
    out["true_mean"] = float((true.double().mean() - lo) / (hi - lo))
    return out
