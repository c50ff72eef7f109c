"""Pull the final answer out of a completion: ``<answer>...</answer>`` or ``\\boxed{...}``.

Every extractor here runs in time linear in the length of the text (a completion is
model output: it may be megabytes of unbalanced braces or repeated tags), so none can
stall the verifier that calls it: :func:`extract_tag` is two backward searches for the
tags, :func:`extract_boxed` one vectorised pass over the braces after the first box.
None of them caps its input: the whole text is looked at, in bounded time; the callers
cap the answers they go on to parse (arithmetic, countdown, math).
"""

from __future__ import annotations

import re

import numpy as np

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_OPEN, _CLOSE = ord("{"), ord("}")


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last complete ``<tag>...</tag>`` block, stripped; None if there is none.

    The last block is the one whose close tag comes last; its content runs from the last
    ``<tag>`` before that close tag (so a stray earlier open tag is ignored). Linear
    time: two backward searches.
    """
    close = f"</{tag}>"
    end = text.rfind(close)
    if end < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : end].strip()


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); a box
    whose braces never close is skipped. Returns None when no complete box exists.

    Linear time, vectorised (a megabyte of ``\\boxed{{{{...`` or of ``{}{}...`` takes
    milliseconds): with ``depth`` the running count of ``{`` minus ``}`` from the first
    box on, a box's ``{`` closes at the first later position where the depth falls back
    below its own, so a box is complete exactly when the minimum depth after it is that
    low. No length cap is needed: the whole text is looked at once.
    """
    openers = [m.end() - 1 for m in _BOXED.finditer(text)]  # the "{" of each box
    if not openers:
        return None
    first = openers[0]
    codes = np.frombuffer(text[first:].encode("utf-32-le", "surrogatepass"), dtype="<u4")
    depth = np.cumsum((codes == _OPEN).astype(np.int64) - (codes == _CLOSE))
    # after[i]: the lowest depth at any position after i (past the end: nothing closes).
    after = np.empty_like(depth)
    after[:-1] = np.minimum.accumulate(depth[:0:-1])[::-1]
    after[-1] = np.iinfo(np.int64).max
    at = np.asarray(openers) - first
    closed = at[after[at] < depth[at]]
    if not len(closed):
        return None
    r = int(closed[-1])
    end = r + 1 + int(np.argmax(depth[r + 1 :] < depth[r]))
    return text[first + r + 1 : first + end].strip()


def extract_answer(text: str) -> str | None:
    """The final answer of a completion.

    Rules, in order: the content of the last complete ``<answer>...</answer>`` block
    (and, if that content holds a ``\\boxed{...}``, the last box inside it); otherwise
    the last complete ``\\boxed{...}`` anywhere; otherwise None. Linear time in the
    length of ``text`` (see :func:`extract_tag` and :func:`extract_boxed`).
    """
    inside = extract_tag(text, "answer")
    if inside is not None:
        boxed = extract_boxed(inside)
        return inside if boxed is None else boxed
    return extract_boxed(text)
