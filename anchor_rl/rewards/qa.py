"""Open-domain QA scores on normalised answers (SQuAD / HotpotQA conventions).

Every score takes one gold answer or a sequence of accepted answers (a gold answer and
its aliases, as in MuSiQue); with several, the score is the maximum over them. Every
function here is linear in the lengths of its inputs (no cap needed: a megabyte-long
prediction is scored in a fraction of a second).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

Gold = str | Sequence[str]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]+")


def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace.

    The SQuAD v1.1 / HotpotQA evaluation normalisation, in that order:
    ``"The  Eiffel-Tower!"`` becomes ``"eiffeltower"``.
    """
    s = s.lower()
    s = _PUNCTUATION.sub("", s)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _best(score: Callable[[str, str], float], pred: str, gold: Gold) -> float:
    """The best ``score`` over the golds, on normalised strings (``pred`` normalised once)."""
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ValueError("no gold answer given")
    p = normalize_answer(pred)
    return max(score(p, normalize_answer(g)) for g in golds)


def _em(p: str, g: str) -> float:
    return float(p == g)


def _f1(p: str, g: str) -> float:
    """Token F1 of two normalised strings."""
    pt, gt = p.split(), g.split()
    if not pt or not gt:
        return float(pt == gt)
    common = sum((Counter(pt) & Counter(gt)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pt), common / len(gt)
    return 2 * precision * recall / (precision + recall)


def _cem(p: str, g: str) -> float:
    """Cover exact match of two normalised strings.

    They are tokens joined by single spaces, so a contiguous run of the gold's tokens is a
    substring match with a space (or an end) on each side: linear, unlike comparing token
    slices at every offset.
    """
    if not g:
        return 0.0
    return float(f" {g} " in f" {p} ")


def exact_match(pred: str, gold: Gold) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    return _best(_em, pred, gold)


def f1(pred: str, gold: Gold) -> float:
    """Token-level F1 between normalised prediction and gold (SQuAD).

    Tokens are the whitespace-split normalised strings; overlap counts multiplicity.
    If either side has no tokens, the score is 1.0 when both are empty, else 0.0.
    """
    return _best(_f1, pred, gold)


def cover_exact_match(pred: str, gold: Gold) -> float:
    """1.0 if the normalised gold appears in the normalised prediction as whole tokens.

    ``"it was paris france"`` covers ``"Paris"``, ``"parisian"`` does not. A gold answer
    that normalises to nothing covers nothing (0.0).
    """
    return _best(_cem, pred, gold)
