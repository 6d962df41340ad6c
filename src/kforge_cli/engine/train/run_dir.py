"""The run directory of a training run: chosen by rank 0, broadcast, locked; its config written once."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from kforge_cli.engine.data.run_tokenizer import record_run_tokenizer
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.errors import InvalidInputError
from kforge_cli.files import check_run_dir, real_dir
from kforge_cli.rundir.layout import RunDir, claim_default_run_dir
from kforge_cli.rundir.lock import RunLock, acquire_run_lock
from kforge_cli.rundir.saved_config import describe_changes, write_or_record
from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")


_LOCKS: dict[Path, RunLock] = {}


def _claim(settings: JobSettings) -> Path:
    """Rank 0: the run directory, created and locked (see `kforge_cli.rundir.lock`)."""
    if settings.train.run_dir:
        run_dir = check_run_dir(Path(settings.train.run_dir)).resolve()
        RunDir(run_dir).refuse_foreign()
    else:
        run_dir = claim_default_run_dir(settings).resolve()
    real_dir(RunDir(run_dir).logs)
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


def write_config(settings: JobSettings, run_dir: Path) -> Path:
    """RUN_DIR/config.toml on a new run; on a continued one, the accepted changes beside it.

    Call it once the run was accepted (after the checkpoint was restored): config.toml is
    written once, when the run starts, and a continuation's changes (e.g. train.max_steps) go
    to RUN_DIR/config_changes.jsonl (see `kforge_cli.rundir.saved_config`). A Hugging Face
    tokenizer of the training data is copied alongside (RUN_DIR/tokenizer.json) so
    `kforge generate` and `kforge eval` still find it if the data directory goes away.
    """
    run = RunDir(run_dir)
    changes = write_or_record(settings, run.path)
    record_run_tokenizer(settings.data, run.path)
    if changes:
        log.info(
            "continuing %s with changed settings (recorded in %s): %s",
            run.path,
            run.config_changes.name,
            describe_changes(changes),
        )
    return run.config
