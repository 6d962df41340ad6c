"""Shared base for settings sections.

Every section forbids unknown keys (so typos are errors, not silently ignored
settings) and every field carries a one-line description: the descriptions are the
documentation printed by ``kforge validate-config --explain KEY``.

Values are checked as untrusted input: no float may be NaN or infinite (``allow_inf_nan``
is off everywhere; ``--optimizer.lr=inf`` would otherwise train to NaN and exit 0), and no
string may hold an unprintable character (a newline in a name or path lands verbatim in log
lines and generated job scripts; a right-to-left override or zero-width space makes it read
as something else): control, format, line/paragraph separator characters and spaces other
than " " are refused (:data:`UNPRINTABLE_CATEGORIES`).
"""

from __future__ import annotations

import types
import typing
import unicodedata
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

_V = TypeVar("_V")

MAX_INT = 2**63 - 1  # every integer setting fits a 64-bit integer (a tensor, a C long, a timedelta's seconds)
SETTINGS_CONFIG = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


def is_int_field(annotation: object) -> bool:
    """``int`` or ``int | None`` (not bool, not a union with other types)."""
    if annotation is int:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = set(typing.get_args(annotation))
        return int in args and args <= {int, type(None)}
    return False


# Unicode categories no setting string may hold: control (Cc), format (Cf: right-to-left overrides,
# zero-width spaces and joiners, soft hyphens), line and paragraph separators (Zl, Zp), surrogates
# (Cs) and private use (Co); of the space separators (Zs) only the plain space " ". Each can make a
# name, path or job-script line read differently from what it is, or end a line where none shows.
UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co"})


def unprintable(char: str) -> bool:
    """True for a character a name, path or script line must not hold (see ``UNPRINTABLE_CATEGORIES``)."""
    category = unicodedata.category(char)
    return category in UNPRINTABLE_CATEGORIES or (category == "Zs" and char != " ")


def describe_character(char: str) -> str:
    """``'\u202e' (U+202E RIGHT-TO-LEFT OVERRIDE)``: what a refusal names."""
    return f"{char!r} (U+{ord(char):04X} {unicodedata.name(char, 'unnamed')})"


def control_character(value: object, where: str = "") -> tuple[str, str] | None:
    """(the first unprintable character in `value` (:func:`unprintable`), where: "" or " in item 0" /
    " in key 'k'"), else None.

    Looks into strings inside lists, tuples and dicts (keys and values); sections validate their own.
    """
    if isinstance(value, str):
        found = next((c for c in value if unprintable(c)), None)
        return (found, where) if found is not None else None
    items: list[tuple[object, str]] = []
    if isinstance(value, list | tuple):
        items = [(v, f"{where} in item {i}") for i, v in enumerate(value)]
    elif isinstance(value, dict):
        items = [(k, f"{where} in key {k!r}") for k in value] + [(v, f"{where} in {k!r}") for k, v in value.items()]
    return next((hit for v, w in items if (hit := control_character(v, w)) is not None), None)


def reject_control_characters(value: _V) -> _V:
    hit = control_character(value)
    if hit is not None:
        char, where = hit
        raise ValueError(
            f"contains a control character or other unprintable one, {describe_character(char)}{where}; names, paths, tags and other "
            "strings must be printable text (no control, format or line-separator characters, no spaces but ' ')"
        )
    return value


class Section(BaseModel):
    """A settings section: strict about unknown keys, finite numbers, printable strings."""

    model_config = SETTINGS_CONFIG

    @field_validator("*", mode="after")
    @classmethod
    def _printable(cls, value: object) -> object:
        return reject_control_characters(value)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers_stay_numbers(cls, value: object, info: ValidationInfo) -> object:
        """An integer field takes an integer: not ``"100"`` (a TOML string) nor ``8.0`` (a float),
        which would otherwise be converted silently (environment variables are parsed before this)."""
        if info.field_name is None or not is_int_field(cls.model_fields[info.field_name].annotation):
            return value
        if isinstance(value, str):
            raise ValueError(f"must be an integer, not the string {value!r}: write it without quotes")
        if isinstance(value, float):
            raise ValueError(f"must be an integer, not the float {value!r}: write it without a decimal point")
        if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
            raise ValueError(f"must be an integer from {-MAX_INT} to {MAX_INT}")
        return value


def field(default: Any, description: str, **kwargs: Any) -> Any:
    """A settings field: a default and a one-line description (both mandatory)."""
    if callable(default):  # list, dict, a section class, or a lambda: a fresh value each time
        return Field(default_factory=default, description=description, **kwargs)
    return Field(default, description=description, **kwargs)
