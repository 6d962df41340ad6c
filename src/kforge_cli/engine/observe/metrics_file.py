"""``RUN_DIR/metrics.jsonl``: one strict-JSON object per logged step.

The file is the run's record that tests, benchmarks and plots read, so it must stay
parseable by any JSON reader: NaN and Inf (a diverged loss) are written as ``null``
rather than Python's non-standard ``NaN``. It is opened in append mode so a resumed
run continues the same file, and flushed after every line so a crash loses nothing
that was logged.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kforge_cli.files import open_append, real_dir


def _to_json_value(value: Any) -> Any:
    """A JSON-safe copy of ``value``: non-finite floats become ``None``.

    Scalars with an ``item()`` method (a 0-d tensor or a numpy number) are unwrapped,
    so a caller that forgot ``.item()`` still gets a number, not an error.
    """
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json_value(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        return _to_json_value(item())
    raise TypeError(f"metrics value {value!r} of type {type(value).__name__} is not JSON serialisable")


class MetricsFile:
    """Appends records to a JSON-lines file (one writer: rank 0)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        real_dir(self.path.parent)
        self._file: IO[str] | None = open_append(self.path)  # refuses a symlinked metrics.jsonl
        needs_newline = self.path.stat().st_size > 0 and not _ends_with_newline(self.path)
        if needs_newline:
            # A previous process died mid-line: end that torn line so ours stays parseable.
            self._file.write("\n")
            self._file.flush()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line, adding ``"time"`` (unix seconds) when absent."""
        if self._file is None:
            raise RuntimeError(f"MetricsFile {self.path} is closed")
        row = dict(record)
        row.setdefault("time", time.time())
        line = json.dumps(_to_json_value(row), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; further writes raise. Safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics file, in order.

    Blank lines and a line that does not parse (a write torn by a killed process) are
    skipped, so a crashed run's file can still be read. A resumed run may log a step
    twice (the steps after the last checkpoint are redone); the later record wins
    for a reader that keys by step.
    """
    records: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                records.append(value)
    return records
