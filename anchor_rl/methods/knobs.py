"""Helpers of the config rules: which knobs of a section are set, the message for a knob that
has no effect in the run, and a section's rules in another host's names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


def in_host_terms(errors: Sequence[str], names: Mapping[str, str]) -> str:
    """A section's ``errors()`` joined by "; ", each setting named as a host (a plug-in) names
    it: ``names`` maps anchor-rl train's name to the host's, replaced in order ("" if none)."""
    text = "; ".join(errors)
    for native, host in names.items():
        text = text.replace(native, host)
    return text
