"""Named things registered with a decorator: estimators, policy losses, engines, components.

One small class, so every registry refuses a name twice (a plug-in would silently replace
a built-in otherwise) and names the registered ones when a lookup fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from anchor_rl.errors import UnknownNameError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """A name -> thing mapping, in registration order.

    kind: what is registered, for messages (``"engine"``, ``"policy loss"``...).
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator registering its argument as ``name`` and returning it unchanged."""

        def decorate(thing: T) -> T:
            self.add(name, thing)
            return thing

        return decorate

    def add(self, name: str, thing: T) -> None:
        """Register ``thing`` as ``name``; ValueError if the name is taken."""
        if name in self:
            raise ValueError(f"a {self.kind} named {name!r} is already registered")
        self[name] = thing

    def lookup(self, name: str) -> T:
        """The thing registered as ``name``; KeyError listing the registered names otherwise."""
        try:
            return self[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self) or 'none'}"
            ) from None
