"""Narrowing values read from JSON or TOML files: what a file holds is ``object`` until checked.

Records kforge writes itself have TypedDicts next to their writers; these helpers are for
reading them back (or any other file) without trusting the contents.
"""

from __future__ import annotations

import json


def int_of(value: object) -> int:
    """``int(value)`` for a number or a numeric string (as ``int()`` takes them); TypeError for anything else."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"{value!r} is not a number")


def dict_of(value: object, what: str = "value") -> dict[str, object]:
    """``value`` when it is a JSON object (a dict); TypeError naming ``what`` otherwise."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is {value!r}, not an object")
    return value


def float_of(value: object) -> float:
    """``float(value)`` for a number or a numeric string; TypeError for anything else."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"{value!r} is not a number")


def list_of(value: object, what: str = "value") -> list[object]:
    """``value`` when it is a JSON array (a list); TypeError naming ``what`` otherwise."""
    if not isinstance(value, list):
        raise TypeError(f"{what} is {value!r}, not a list")
    return value


MAX_LINE_BYTES = 1 << 16  # a kforge record is well under 4 KB; a longer line is not one (skipped unread)
MAX_INT_DIGITS = 19  # a step, a token count or a loss kforge logs fits in 64 bits


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")  # the line is damaged: skipped like any other
    return int(text)


def record_of(line: bytes | str) -> dict[str, object] | None:
    """One line as a record; None for a blank, over-long or damaged line (not JSON, not UTF-8, nested too
    deep, an integer of more than 19 digits, which no float or tensor takes: JSONDecodeError and
    UnicodeDecodeError are ValueErrors)."""
    if len(line) > MAX_LINE_BYTES or not line.strip():
        return None
    try:
        value: object = json.loads(line, parse_int=_bounded_int)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
