"""Open-domain QA scores on normalised answers (SQuAD / HotpotQA conventions).

Every score takes one gold answer or a sequence of accepted answers (a gold answer and
its aliases, as in MuSiQue); with several, the score is the maximum over them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

Gold = str | Sequence[str]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace.

    The SQuAD v1.1 / HotpotQA evaluation normalisation, in that order:
    ``"The  Eiffel-Tower!"`` becomes ``"eiffeltower"``.
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split()


def _best(score: Callable[[str, str], float], pred: str, gold: Gold) -> float:
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ValueError("no gold answer given")
    return max(score(pred, g) for g in golds)


def _em(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def _f1(pred: str, gold: str) -> float:
    p, g = _tokens(pred), _tokens(gold)
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def _cem(pred: str, gold: str) -> float:
    p, g = _tokens(pred), _tokens(gold)
    if not g:
        return 0.0
    n = len(g)
    return float(any(p[i : i + n] == g for i in range(len(p) - n + 1)))


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
