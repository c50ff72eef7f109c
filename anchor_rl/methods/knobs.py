"""Helpers of the config rules: which knobs of a section are set, and the message for a knob
that has no effect in the run."""

from __future__ import annotations

from pydantic import BaseModel


def changed(section: BaseModel, names: tuple[str, ...] | None = None) -> list[str]:
    """Fields of ``section`` (all, or ``names``) whose value differs from the default."""
    fields = type(section).model_fields
    return [
        name
        for name in (names or tuple(fields))
        if getattr(section, name) != fields[name].get_default(call_default_factory=True)
    ]


def no_effect(section: str, names: list[str], why: str) -> str:
    """``SECTION.A, SECTION.B have no effect: WHY``."""
    keys = ", ".join(f"{section}.{n}" for n in names)
    return f"{keys} {'has' if len(names) == 1 else 'have'} no effect: {why}"
