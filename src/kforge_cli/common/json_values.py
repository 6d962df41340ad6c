"""Narrowing values read from JSON or TOML files: what a file holds is ``object`` until checked.

Records kforge writes itself have TypedDicts next to their writers; these helpers are for
reading them back (or any other file) without trusting the contents.
"""

from __future__ import annotations


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
