"""Shared base for settings sections.

Every section forbids unknown keys (so typos are errors, not silently ignored
settings) and every field carries a one-line description: the descriptions are the
documentation printed by ``kforge validate-config --explain KEY``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A settings section: strict about unknown keys, validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def field(default: Any, description: str, **kwargs: Any) -> Any:
    """A settings field: a default and a one-line description (both mandatory)."""
    if callable(default):  # list, dict, a section class, or a lambda: a fresh value each time
        return Field(default_factory=default, description=description, **kwargs)
    return Field(default, description=description, **kwargs)
