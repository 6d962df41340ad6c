"""The run directory: chosen by rank 0, broadcast, and stamped with the resolved config."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from kforge_cli.engine.data.run_tokenizer import record_run_tokenizer
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.errors import InvalidInputError
from kforge_cli.files import atomic_write, check_run_dir, real_dir
from kforge_cli.rundir.layout import claim_default_run_dir
from kforge_cli.rundir.lock import RunLock, acquire_run_lock, refuse_foreign_dir
from kforge_cli.rundir.saved_config import conflicts_with_saved_config
from kforge_cli.settings import JobSettings
from kforge_cli.settings.explain import to_toml

log = logging.getLogger("kforge")


_LOCKS: dict[Path, RunLock] = {}


def _claim(settings: JobSettings) -> Path:
    """Rank 0: the run directory, created and locked (see `run_lock`)."""
    if settings.train.run_dir:
        run_dir = check_run_dir(Path(settings.train.run_dir)).resolve()
        refuse_foreign_dir(run_dir)
    else:
        run_dir = claim_default_run_dir(settings).resolve()
    real_dir(run_dir / "logs")
    _LOCKS[run_dir] = acquire_run_lock(run_dir)
    return run_dir


def resolve_run_dir(settings: JobSettings, runtime: RuntimeContext) -> Path:
    """RUN_DIR (absolute): train.run_dir, or a fresh default one; rank 0 decides, creates and locks it.

    A refusal on rank 0 (a file, a foreign directory, a run in progress) is broadcast so
    every rank raises it instead of waiting. Release the lock with :func:`release_run_dir`.
    """
    chosen: list[str | None] = [None, None]  # (run dir, error)
    if runtime.is_main:
        try:
            chosen[0] = str(_claim(settings))
        except InvalidInputError as exc:
            chosen[1] = str(exc)
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[1] is not None:
        raise InvalidInputError(chosen[1])
    assert chosen[0] is not None
    return Path(chosen[0])


def release_run_dir(run_dir: Path) -> None:
    """Free the run directory's lock (this process's; a no-op on other ranks)."""
    lock = _LOCKS.pop(Path(run_dir), None)
    if lock is not None:
        lock.release()


def with_run_dir(settings: JobSettings, run_dir: Path) -> JobSettings:
    """A copy of ``settings`` that names ``run_dir`` (what the run's config.toml records)."""
    return settings.model_copy(update={"train": settings.train.model_copy(update={"run_dir": str(run_dir)})})


def write_config(settings: JobSettings, run_dir: Path) -> Path:
    """RUN_DIR/config.toml: the fully resolved settings (written atomically).

    On a resume the file takes the new settings, except when they change the model's
    shape while RUN_DIR holds a checkpoint: then the original stays (the resume is refused
    when the checkpoint is opened, and `kforge resume` still finds the run's real config).
    A Hugging Face tokenizer of the training data is copied alongside (RUN_DIR/tokenizer.json)
    so `kforge generate` and `kforge eval` still find it if the data directory goes away.
    """
    path = run_dir / "config.toml"
    record_run_tokenizer(settings.data, run_dir)
    conflicts = conflicts_with_saved_config(settings, run_dir)
    if conflicts:
        log.warning("keeping %s: these settings change the model's shape (%s)", path, "; ".join(conflicts))
        return path
    atomic_write(path, to_toml(with_run_dir(settings, run_dir)).encode())  # never through a planted link
    return path
