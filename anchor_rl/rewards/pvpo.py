"""The PVPO reward manager (arXiv 2508.21104): a format floor and F1 or cover-exact-match."""

from __future__ import annotations

from collections.abc import Sequence

from anchor_rl.rewards.extract import extract_tag
from anchor_rl.rewards.format import format_ok
from anchor_rl.rewards.qa import Gold, _cem, _f1, normalize_answer


def reward(completion: str, gold: Gold, n: int = 3, tools: Sequence[str] = ("search",)) -> float:
    """PVPO's reward of one completion.

    0.0 if the format is wrong (:func:`anchor_rl.rewards.format.format_ok` with ``tools``);
    otherwise ``max(0.1, r_acc)`` where, with ``pred`` the content of the answer block
    and lengths counted in normalised tokens,

    - ``r_acc = f1(pred, gold)`` if ``len(pred) >= n * len(gold)`` (a long answer must be
      precise), else
    - ``r_acc = cover_exact_match(pred, gold)``.

    With several accepted answers, the rule is applied to each and the best is kept.
    Linear time in the length of the completion.
    """
    if not format_ok(completion, tools):
        return 0.0
    pred = normalize_answer(extract_tag(completion, "answer") or "")
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ValueError("no gold answer given")
    n_pred = len(pred.split())
    r_acc = 0.0
    for g in map(normalize_answer, golds):  # the prediction is normalised once
        r_acc = max(r_acc, _f1(pred, g) if n_pred >= n * len(g.split()) else _cem(pred, g))
    return max(0.1, r_acc)
