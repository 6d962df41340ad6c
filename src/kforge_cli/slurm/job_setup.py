"""`--sbatch`: create the run directory, write its config.toml and job.sbatch, optionally submit.

The job's tasks run `kforge train --run-dir RUN_DIR`, which continues the run with its saved
settings, so the run directory and its config must exist before the job starts; a requeued job
runs the same command on the same directory and resumes from the latest checkpoint. On an
existing run config.toml stays as it is and the accepted changes are recorded beside it
(`kforge_cli.rundir.saved_config`). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from kforge_cli.common.files import atomic_write, check_run_dir, open_append, real_dir
from kforge_cli.errors import EXIT_OK, ConfigError
from kforge_cli.rundir.layout import RunDir, claim_default_run_dir, default_run_dir
from kforge_cli.rundir.saved_config import continuation_issues, has_checkpoint, saved_settings, write_or_record
from kforge_cli.settings import JobSettings
from kforge_cli.slurm.sbatch import render_sbatch, task_python
from kforge_cli.slurm.submit import submit_script


@dataclass(frozen=True)
class JobFiles:
    run_dir: Path
    config: Path
    script: Path


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write(path, text.encode(), mode)  # never through a planted link


def _refuse_continuation(settings: JobSettings, run: RunDir) -> None:
    """An existing run with a checkpoint cannot be continued by a job of another model shape or data order."""
    if not run.has_config():
        return
    saved = saved_settings(run.path)
    issues = continuation_issues(saved, settings, checkpoint=has_checkpoint(run.path, saved))
    if issues:
        raise ConfigError(
            issues,
            header=f"cannot write a job that continues {run.path}: it holds a checkpoint of a differently shaped "
            "model or another data order",
            fix=f"use a new --run-dir, or start from its weights with --checkpoint.init_from={run.path}",
        )


def write_job(settings: JobSettings, *, python: str | None = None, workdir: Path | None = None) -> JobFiles:
    """Write RUN_DIR/config.toml (a new run) or record the accepted changes (an existing one), RUN_DIR/job.sbatch.

    `python` is the interpreter the tasks run (default: slurm.python, else `python` from the
    environment slurm.setup activates, else this one by absolute path: compute nodes share
    the filesystem); `workdir` is the job's working directory (default: the
    current one), where relative paths in the settings are resolved.
    RUN_DIR follows `kforge train`'s rules: a default name is claimed atomically (two jobs
    written in the same second get two directories), and a given directory must be new,
    empty or a kforge run. Everything is checked before anything is created.
    """
    workdir = (workdir or Path.cwd()).resolve()
    given = settings.train.run_dir
    run_dir = Path(given or default_run_dir(settings)).expanduser()
    run_dir = (run_dir if run_dir.is_absolute() else workdir / run_dir).resolve()
    settings = settings.model_copy(deep=True)
    settings.train.run_dir = str(run_dir)
    interpreter = python or task_python(settings.slurm, sys.executable)
    script = render_sbatch(settings, run_dir, python=interpreter, workdir=workdir)  # refuses before creating
    if given:
        RunDir(check_run_dir(run_dir)).refuse_foreign()
        _refuse_continuation(settings, RunDir(run_dir))
    else:  # the name checked above, or the next free one: render again with the name claimed
        run_dir = claim_default_run_dir(settings, base=workdir).resolve()
        settings.train.run_dir = str(run_dir)
        script = render_sbatch(settings, run_dir, python=interpreter, workdir=workdir)
    run = RunDir(run_dir)
    files = JobFiles(run_dir, run.config, run.job_script)
    lock = _run_lock(run_dir) if given else contextlib.nullcontext()  # a default dir was just claimed: new
    with lock:  # a live run's settings are never changed under it; refused before any write
        real_dir(run.logs)
        write_or_record(settings, run_dir)  # config.toml once; the changes of a later job beside it
        _atomic_write(files.script, script, 0o755)
    return files


def _run_lock(run_dir: Path) -> contextlib.AbstractContextManager[object]:
    """The run directory's lock, held while its files are written (RunDirInUseError while a run holds it).

    `kforge resume RUN --sbatch` on a run that is training would otherwise replace its config.toml
    mid-run.
    """
    if not run_dir.is_dir():
        return contextlib.nullcontext()
    from kforge_cli.rundir.lock import acquire_run_lock

    return acquire_run_lock(run_dir, wait_s=0)


def sbatch_from_cli(settings: JobSettings, *, submit: bool) -> int:
    """`--sbatch`: print the script (a dry run, no SLURM needed); `--submit`: submit it and print the job id."""
    files = write_job(settings)
    if not submit:
        typer.echo(files.script.read_text(), nl=False)
        typer.echo(f"wrote {files.script} and {files.config}; submit with: sbatch {files.script}", err=True)
        return EXIT_OK
    job_id = submit_script(files.script)
    record_submission(files.run_dir, job_id)
    typer.echo(f"submitted {files.script} as job {job_id}; logs in {RunDir(files.run_dir).logs}", err=True)
    typer.echo(job_id)
    return EXIT_OK


def record_submission(run_dir: Path, job_id: str) -> None:
    """Append the submitted job's id to RUN_DIR/slurm_jobs.jsonl (`kforge runs` asks SLURM about it)."""
    record = {"job_id": job_id, "submitted": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
    with open_append(RunDir(run_dir).slurm_jobs) as f:  # never through a planted link
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
