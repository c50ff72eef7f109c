"""Pull the final answer out of a completion: ``<answer>...</answer>`` or ``\\boxed{...}``."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last complete ``<tag>...</tag>`` block, stripped; None if there is none.

    The last block is the one whose close tag comes last; its content runs from the last
    ``<tag>`` before that close tag (so a stray earlier open tag is ignored).
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
    """
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion.

    Rules, in order: the content of the last complete ``<answer>...</answer>`` block
    (and, if that content holds a ``\\boxed{...}``, the last box inside it); otherwise
    the last complete ``\\boxed{...}`` anywhere; otherwise None.
    """
    inside = extract_tag(text, "answer")
    if inside is not None:
        boxed = extract_boxed(inside)
        return inside if boxed is None else boxed
    return extract_boxed(text)
