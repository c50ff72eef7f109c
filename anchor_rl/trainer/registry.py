"""The registry of method components a config can add by name (``components = [NAME]``).

Kept apart from :mod:`anchor_rl.trainer.component` (the protocol), so the config can check
names without importing the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from anchor_rl.registry import Registry

ComponentFactory = Callable[..., Any]
"""``factory(setup, **component_args[NAME]) -> Component``: a Component class or a function."""

COMPONENTS: Registry[ComponentFactory] = Registry("component")
"""Registered components, built after the built-in ones (PVPO, V0.5 and the critic follow
from the estimator's inputs, see ``run.build_components``)."""


def register_component(name: str) -> Callable[[ComponentFactory], ComponentFactory]:
    """Register the decorated factory (a Component class or a function returning one) as
    ``name``; returned unchanged."""
    return COMPONENTS.register(name)
