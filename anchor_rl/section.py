"""The base of every config section: unknown keys refused, fields documented, frozen, and
no boolean where a number belongs.

Pydantic's lax mode reads ``true`` as 1 for an int field (``eval.prompts=true`` would
evaluate one prompt); a section refuses it instead, naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_NUMBERS = (int, float, int | None, float | None)


class Section(BaseModel):
    """A config section (``rollout``, ``pvpo``...) or the whole config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if isinstance(value, bool) and name and cls.model_fields[name].annotation in _NUMBERS:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value
