"""The output-format check: well-formed tags, tool calls answered, one final answer at the end."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache


@lru_cache(maxsize=32)
def _tag_pattern(tools: tuple[str, ...]) -> re.Pattern[str]:
    names = "|".join(re.escape(t) for t in ("think", "answer", "result", *tools))
    return re.compile(rf"<(/?)({names})>")


def format_ok(text: str, tools: Sequence[str] = ("search",)) -> bool:
    """Whether a completion is well-formed.

    Recognised tags are ``think``, ``answer``, ``result`` and each name in ``tools``.
    A completion is well-formed when all of these hold:

    1. blocks do not nest and every open tag is closed by its own close tag;
    2. every tool call ``<tool>...</tool>`` is followed, after whitespace only, by a
       ``<result>...</result>`` block, and every result block follows a tool call;
    3. there is exactly one ``<answer>...</answer>`` block, its content is not blank,
       and only whitespace follows it.

    Free text outside blocks (before the answer) is allowed; ``<think>`` is optional.
    Linear time: one regular-expression scan for the tags.
    """
    open_tag: str | None = None
    awaiting_result = False
    answered = False
    last_end = 0
    for match in _tag_pattern(tuple(tools)).finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        if answered:
            return False
        if closing:
            if open_tag != name:
                return False
            if name == "answer":
                if not text[last_end : match.start()].strip():
                    return False
                answered = True
            awaiting_result = name in tools
            open_tag = None
        else:
            if open_tag is not None:
                return False
            if awaiting_result != (name == "result"):
                return False
            if awaiting_result and text[last_end : match.start()].strip():
                return False
            open_tag = name
        last_end = match.end()
    return answered and not text[last_end:].strip()


def format_score(text: str, tools: Sequence[str] = ("search",)) -> float:
    """1.0 if :func:`format_ok`, else 0.0."""
    return float(format_ok(text, tools))
