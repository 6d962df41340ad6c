"""Per-rank logging for the ``kforge`` logger.

With hundreds of processes writing to one console, a line is only useful if it says
which rank wrote it, and the console is only readable if most ranks stay quiet. So
every line carries ``[rank N]``; rank 0 prints INFO and above to stderr, the other
ranks only WARNING and above; and each rank keeps a full log in ``logs/rank_N.log``
so nothing is lost when a non-zero rank is the one that misbehaves.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import IO, TextIO

from kforge_cli.common.files import open_append, real_dir
from kforge_cli.errors import InvalidInputError

LOGGER_NAME = "kforge"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

# A record logged with ``extra={SKIP_CONSOLE: True}`` goes to the per-rank file but not
# to stderr: the progress bar uses it so its lines are kept in the file while the
# console shows the bar instead.
SKIP_CONSOLE = "kforge_skip_console"

_HANDLER_MARK = "_kforge_handler"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time.

    A handler that captured ``sys.stderr`` once would keep writing to a stale stream
    when a rich progress bar (or pytest) swaps it; looking it up on each record lets
    log lines appear above a live progress bar.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:  # pyright: ignore[reportIncompatibleVariableOverride]
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        """Ignore the assignment made by ``StreamHandler.__init__``: the stream is looked up."""


def _not_console_skipped(record: logging.LogRecord) -> bool:
    return not getattr(record, SKIP_CONSOLE, False)


def _parse_level(level: str) -> int:
    name = level.upper()
    if name not in _LEVELS:
        raise InvalidInputError(f"unknown log level {level!r}: use one of {', '.join(_LEVELS)}")
    return logging.getLevelNamesMapping()[name]


class _NoFollowFileHandler(logging.FileHandler):
    """A FileHandler that refuses a log file that is a symbolic link (it would append to the link's target)."""

    def _open(self) -> IO[str]:
        return open_append(Path(self.baseFilename), encoding=self.encoding or "utf-8")


def setup_logging(rank: int, world_size: int, log_dir: Path | None, level: str = "INFO") -> logging.Logger:
    """Configure the ``kforge`` logger for this rank and return it.

    Idempotent: handlers installed by an earlier call are closed and replaced, so
    calling it again (a second run in one process, a test) neither duplicates lines
    nor leaks file handles. The logger does not propagate to the root logger, so a
    library's ``basicConfig`` cannot print every line twice.
    """
    numeric_level = _parse_level(level)
    logger = logging.getLogger(LOGGER_NAME)
    shutdown_logging()
    logger.setLevel(numeric_level)
    logger.propagate = False
    formatter = logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", datefmt=DATE_FORMAT)

    console = _CurrentStderrHandler()
    console.setLevel(numeric_level if rank == 0 else max(numeric_level, logging.WARNING))
    console.setFormatter(formatter)
    console.addFilter(_not_console_skipped)
    setattr(console, _HANDLER_MARK, True)
    logger.addHandler(console)

    if log_dir is not None:
        real_dir(log_dir)
        file_handler = _NoFollowFileHandler(log_dir / f"rank_{rank}.log", mode="a", encoding="utf-8")
        file_handler.setLevel(numeric_level)
        file_handler.setFormatter(formatter)
        setattr(file_handler, _HANDLER_MARK, True)
        logger.addHandler(file_handler)

    if rank != 0:
        # Python warnings (a library's UserWarning raised the same on every rank) reach the console once,
        # from rank 0; the other ranks keep theirs in their own file.
        logging.captureWarnings(True)
        py_warnings = logging.getLogger("py.warnings")
        py_warnings.propagate = False
        for handler in logger.handlers:
            if handler is not console:
                py_warnings.addHandler(handler)
        if not py_warnings.handlers:
            py_warnings.addHandler(logging.NullHandler())
        setattr(py_warnings, _HANDLER_MARK, True)

    logger.debug("logging set up for rank %d of %d (level %s)", rank, world_size, level.upper())
    return logger


def shutdown_logging() -> None:
    """Remove and close the handlers :func:`setup_logging` installed (flushes the rank file)."""
    logger = logging.getLogger(LOGGER_NAME)
    py_warnings = logging.getLogger("py.warnings")
    if getattr(py_warnings, _HANDLER_MARK, False):  # a rank other than 0 routed Python warnings to its file
        logging.captureWarnings(False)
        for handler in list(py_warnings.handlers):
            py_warnings.removeHandler(handler)
        py_warnings.propagate = True
        delattr(py_warnings, _HANDLER_MARK)
    for handler in list(logger.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            logger.removeHandler(handler)
            handler.close()


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``kforge`` logger, or its child ``kforge.<name>`` (which shares its handlers)."""
    return logging.getLogger(LOGGER_NAME if name is None else f"{LOGGER_NAME}.{name}")
