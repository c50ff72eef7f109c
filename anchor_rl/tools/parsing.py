"""Tool-call parsing and tool-result formatting for the agent loop.

A tool call is ``<{tag}>query</{tag}>`` in the policy's text; the environment answers
with ``format_result(output)`` appended right after the close tag, no whitespace.
:func:`split_tool_output` finds those result blocks again in a finished completion.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
_TAG_LIKE = re.compile(r"</?[A-Za-z_][\w-]*>")


def parse_tool_call(text: str, tags: Iterable[str]) -> tuple[str, str] | None:
    """The last complete tool call in ``text`` as ``(tag, query)``, or None.

    Complete means closed: the call whose ``</tag>`` comes last among ``tags``, with the
    query read from the last ``<tag>`` before it and stripped. A close tag without an
    opening tag before it is no call. The agent loop passes the text of the turn that
    just ended on a close tag, so the last call is the pending one. Linear time: two
    backward searches per tag.
    """
    best: tuple[int, str, str] | None = None
    for tag in tags:
        close = f"</{tag}>"
        end = text.rfind(close)
        if end < 0 or (best is not None and end < best[0]):
            continue
        start = text.rfind(f"<{tag}>", 0, end)
        if start < 0:
            continue
        best = (end, tag, text[start + len(tag) + 2 : end].strip())
    return None if best is None else (best[1], best[2])


def format_result(text: str, max_chars: int | None = None) -> str:
    """``<result>text</result>``, with tag-like substrings removed from ``text``.

    Removing ``<...>`` tags keeps a document from closing the block early or injecting
    an answer. With ``max_chars``, text longer than that is cut to ``max_chars`` characters
    ending in ``...``.
    """
    text = _TAG_LIKE.sub("", text)
    if max_chars is not None and len(text) > max_chars:
        if max_chars < 3:
            raise ValueError(f"max_chars must be >= 3, got {max_chars}")
        text = text[: max_chars - 3] + "..."
    return f"{RESULT_OPEN}{text}{RESULT_CLOSE}"


def split_tool_output(text: str) -> list[tuple[str, bool]]:
    """Split a completion into ``(segment, written_by_policy)`` pieces, in order.

    The result blocks :func:`format_result` writes are the environment's (``False``); the
    text around them is the policy's (``True``). A block runs from a ``<result>`` to the
    first ``</result>`` after it; an open tag with no close after it starts no block.
    Empty pieces are left out. Linear time: each block is found with two forward
    searches that never look back.
    """
    pieces: list[tuple[str, bool]] = []
    start = 0
    while (open_at := text.find(RESULT_OPEN, start)) >= 0:
        close_at = text.find(RESULT_CLOSE, open_at + len(RESULT_OPEN))
        if close_at < 0:  # no close after this open, so none after any later open either
            break
        end = close_at + len(RESULT_CLOSE)
        if open_at > start:
            pieces.append((text[start:open_at], True))
        pieces.append((text[open_at:end], False))
        start = end
    if start < len(text):
        pieces.append((text[start:], True))
    return pieces
