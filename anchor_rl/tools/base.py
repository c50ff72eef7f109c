"""The tool contract: a callable from a query string to a result string."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tool(Protocol):
    """A tool the policy calls as ``<{name}>query</{name}>``.

    The environment answers with ``<result>{tool(query)}</result>``. A tool must not
    raise on bad input: it returns an error message the model can read.
    """

    name: str

    def __call__(self, query: str) -> str: ...
