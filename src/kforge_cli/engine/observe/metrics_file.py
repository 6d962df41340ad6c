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
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

from kforge_cli.common.files import open_append, open_regular, real_dir
from kforge_cli.common.json_values import MAX_LINE_BYTES, record_of


def _to_json_value(value: object) -> object:
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

    def write(self, record: Mapping[str, object]) -> None:
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


def iter_metrics(path: Path) -> Iterator[dict[str, object]]:
    """The records of a metrics file, in order, one line in memory at a time.

    Blank lines and a line that does not parse (a write torn by a killed process, bytes
    that are not UTF-8, nesting too deep, a number too long) are skipped, so a crashed
    or damaged run's file can still be read; so is a line longer than ``MAX_LINE_BYTES``,
    without reading it whole. A FIFO or device is refused (``files.open_regular``). A
    resumed run may log a step twice (the steps after the last checkpoint are redone); the
    later record wins for a reader that keys by step.
    """
    with open_regular(path) as f:
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):  # skip the rest of an over-long line
                    line = f.readline(MAX_LINE_BYTES + 1)
                continue
            record = record_of(line)
            if record is not None:
                yield record


def tail_records(path: Path, max_bytes: int = 8 << 20) -> Iterator[dict[str, object]]:
    """The records in the last `max_bytes` of the file, newest first (a reader of the latest values
    costs the same for a 100 KB and a 100 GB file)."""
    with open_regular(path) as f:
        size = f.seek(0, 2)
        start = max(0, size - max_bytes)
        f.seek(start)
        lines = f.read(size - start).split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first one is cut
    for line in reversed(lines):
        record = record_of(line)
        if record is not None:
            yield record


def sample_records(path: Path, points: int) -> Iterator[dict[str, object]]:
    """About `points` records spread evenly over the file by byte offset, in order, then its last record.

    For files too large to read whole: each sample seeks and reads one line, so time and
    memory follow `points`, not the file's size.
    """
    with open_regular(path) as f:
        size = f.seek(0, 2)
        for i in range(points):
            f.seek(i * size // points)
            if i:
                f.readline(MAX_LINE_BYTES + 1)  # the rest of the line the offset fell into
            record = record_of(f.readline(MAX_LINE_BYTES + 1))
            if record is not None:
                yield record
    last = next(tail_records(path, 2 * MAX_LINE_BYTES), None)
    if last is not None:
        yield last


def count_lines(path: Path) -> int:
    """Newlines in the file, counted in 1 MiB blocks (a cheap first pass for readers that sample)."""
    n = 0
    with open_regular(path) as f:
        while block := f.read(1 << 20):
            n += block.count(b"\n")
    return n


def read_metrics(path: Path) -> list[dict[str, object]]:
    """All records of a metrics file, in order (see :func:`iter_metrics`)."""
    return list(iter_metrics(path))
