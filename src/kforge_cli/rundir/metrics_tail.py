"""The newest values in a run's ``metrics.jsonl``, read backwards from its end (torch-free).

What ``kforge runs`` shows (last loss, eval loss) and how far ``kforge data-trace`` knows a run
trained: the cost is the same for a 100 KB and a 100 GB file (at most ``TAIL_LIMIT`` bytes are
read). A FIFO or device is skipped, never read; a damaged line is skipped.
"""

from __future__ import annotations

from pathlib import Path

from kforge_cli.common.files import open_regular
from kforge_cli.common.json_values import record_of
from kforge_cli.errors import KforgeError

TAIL_BLOCK = 64 * 1024
TAIL_LIMIT = 8 * 1024 * 1024  # look back at most this far


def last_values(path: Path, keys: tuple[str, ...]) -> dict[str, tuple[int, float]]:
    """The last (step, value) of each of `keys` in a metrics.jsonl, read backwards from its end."""
    found: dict[str, tuple[int, float]] = {}
    try:
        f = open_regular(path)  # a FIFO or device in a run directory is skipped, never read (it could block)
    except (OSError, KforgeError):
        return found
    with f:
        end = f.seek(0, 2)
        pos, carry = end, b""
        while pos > 0 and len(found) < len(keys) and end - pos < TAIL_LIMIT:
            start = max(0, pos - TAIL_BLOCK)
            f.seek(start)
            chunk = f.read(pos - start) + carry
            lines = chunk.split(b"\n")
            carry = lines.pop(0) if start > 0 else b""  # maybe a partial line: join it to the next block
            pos = start
            for line in reversed(lines):
                _take(line, keys, found)
        if pos == 0 and carry:
            _take(carry, keys, found)
    return found


def _take(line: bytes, keys: tuple[str, ...], found: dict[str, tuple[int, float]]) -> None:
    wanted = [k for k in keys if k not in found and f'"{k}"'.encode() in line]
    if not wanted:
        return
    record = record_of(line)  # damaged, or holding an integer no float takes: skipped
    step = record.get("step") if record is not None else None
    if record is None or not isinstance(step, int):
        return
    for key in wanted:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[key] = (step, float(value))
