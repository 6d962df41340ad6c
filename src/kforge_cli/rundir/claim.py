"""The run directory this process holds: claimed (created, checked, locked) by a job's rank 0.

One home for the claim: the lock itself is :mod:`kforge_cli.rundir.lock`; this module keeps
which directory this process locked, so the training releases it when the run ends however
it ends, and the command records the job's exit code in the directory it actually took (not
one refused "in use"). Torch-free: the engine broadcasts rank 0's choice
(``engine.train.run_dir.resolve_run_dir``), the command reads :func:`claimed_run_dir`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import check_run_dir, real_dir
from kforge_cli.rundir.launch import clear_exit
from kforge_cli.rundir.layout import RunDir, claim_default_run_dir
from kforge_cli.rundir.lock import RunLock, acquire_run_lock

if TYPE_CHECKING:
    from kforge_cli.settings import JobSettings

_held: dict[Path, RunLock] = {}  # run directory -> its lock, for the life of the run
_claimed: list[Path] = []  # the run directory of this process's current job (rank 0)


def claim_run_dir(settings: JobSettings) -> Path:
    """RUN_DIR for a job's rank 0: ``train.run_dir`` (checked: not a link, not a foreign
    directory) or a fresh default one; created with its ``logs/`` and locked until
    :func:`release_run_dir`. The previous job's exit record is cleared (this job writes its own)."""
    if settings.train.run_dir:
        run_dir = check_run_dir(Path(settings.train.run_dir)).resolve()
        RunDir(run_dir).refuse_foreign()
    else:
        run_dir = claim_default_run_dir(settings).resolve()
    real_dir(RunDir(run_dir).logs)
    _held[run_dir] = acquire_run_lock(run_dir)
    _claimed.append(run_dir)
    clear_exit(run_dir)
    return run_dir


def forget_claim() -> None:
    """A new job in this process: nothing claimed for it yet (its exit goes nowhere until it claims)."""
    _claimed.clear()


def claimed_run_dir() -> Path | None:
    """The run directory this process locked for its job (rank 0 only; None elsewhere)."""
    return _claimed[-1] if _claimed else None


def release_run_dir(run_dir: Path) -> None:
    """Free the run directory's lock (this process's; a no-op where it holds none)."""
    lock = _held.pop(Path(run_dir), None)
    if lock is not None:
        lock.release()
