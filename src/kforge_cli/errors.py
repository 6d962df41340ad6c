"""Errors a user can cause.

Every mistake a researcher can make (a bad config value, a missing file, an
incompatible checkpoint) raises a :class:`KforgeError` subclass whose message says
what is wrong and how to fix it. The CLI prints the message without a traceback and
exits with the error's ``exit_code``. This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID_INPUT = 2
EXIT_REQUEUE = 75  # stopped on a signal after saving a checkpoint: requeue me
EXIT_INTERRUPTED = 130  # a second Ctrl-C before the stop's checkpoint was complete (as a shell reports SIGINT)
EXIT_HANG = 76  # the hang watchdog stopped a rank that made no progress: requeue me (resume from the last checkpoint)


def bug_report_hint() -> str:
    """Where to report a kforge bug: the package's issue tracker URL when its metadata names one."""
    try:
        from importlib.metadata import PackageNotFoundError, metadata

        urls = metadata("kforge").get_all("Project-URL") or []
    except (ImportError, PackageNotFoundError):
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("issues", "bug tracker", "bugs", "source", "repository", "homepage"):
            return f"Please report it at {url.strip()} with the command and the traceback above."
    return "Please report it to the kforge maintainers (the project's issue tracker) with the command and the traceback above."


class SavedInterrupt(KeyboardInterrupt):
    """A second Ctrl-C after the stop's checkpoint of the current step was complete: exit 75, not 130."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class KforgeError(Exception):
    """Base class of errors caused by the user's input or environment."""

    exit_code: int = EXIT_FAILURE


class InvalidInputError(KforgeError):
    """Bad input (a file, a flag, a path): exit code 2."""

    exit_code = EXIT_INVALID_INPUT


class CheckpointError(InvalidInputError):
    """A checkpoint cannot be used as asked (exit 2): the message names the path and the fix."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem with a configuration, tied to the dotted path of the field."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(KforgeError):
    """One or more problems with the resolved configuration: all are reported at once."""

    exit_code = EXIT_INVALID_INPUT

    def __init__(
        self, issues: list[ConfigIssue], header: str = "invalid configuration", fix: str | None = None
    ) -> None:
        self.issues = list(issues)
        n = len(self.issues)
        lines = [f"{header} ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in self.issues]
        if fix:
            lines.append(f"fix: {fix}")
        super().__init__("\n".join(lines))


class TrainingAborted(KforgeError):
    """Training stopped because of a policy decision (e.g. NaN abort): exit 1."""

    exit_code = EXIT_FAILURE
