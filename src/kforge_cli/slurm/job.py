"""`--sbatch`: create the run directory, write its config.toml and job.sbatch, optionally submit.

The job's tasks run `kforge train` on RUN_DIR/config.toml, so the run directory and its config
must exist before the job starts; a requeued job runs the same command on the same directory
and resumes from the latest checkpoint. Nothing here imports torch, except the check of an
existing run directory's checkpoint against new settings (shared with the engine).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from kforge_cli.errors import EXIT_OK, InvalidInputError
from kforge_cli.files import atomic_write, check_run_dir, real_dir
from kforge_cli.settings import JobSettings
from kforge_cli.settings.explain import to_toml
from kforge_cli.settings.run_dir import claim_default_run_dir, default_run_dir, refuse_foreign_dir
from kforge_cli.slurm.sbatch import CONFIG_FILE, SCRIPT_FILE, render_sbatch, task_python
from kforge_cli.slurm.submit import submit_script


@dataclass(frozen=True)
class JobFiles:
    run_dir: Path
    config: Path
    script: Path


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write(path, text.encode(), mode)  # never through a planted link


def _refuse_shape_change(settings: JobSettings, run_dir: Path) -> None:
    """An existing run with a checkpoint of a differently shaped model cannot be continued by this job."""
    if not (run_dir / CONFIG_FILE).is_file():
        return
    from kforge_cli.engine.checkpoint.run_config import conflicts_with_saved_config

    conflicts = conflicts_with_saved_config(settings, run_dir)
    if conflicts:
        raise InvalidInputError(
            f"{run_dir} holds a checkpoint of a differently shaped model ({'; '.join(conflicts)}); "
            f"use a new --run-dir, or start from its weights with --checkpoint.init_from={run_dir}"
        )


def write_job(settings: JobSettings, *, python: str | None = None, workdir: Path | None = None) -> JobFiles:
    """Write RUN_DIR/config.toml (the resolved settings) and RUN_DIR/job.sbatch; create RUN_DIR/logs.

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
        refuse_foreign_dir(check_run_dir(run_dir))
        _refuse_shape_change(settings, run_dir)
    else:  # the name checked above, or the next free one: render again with the name claimed
        run_dir = claim_default_run_dir(settings, base=workdir).resolve()
        settings.train.run_dir = str(run_dir)
        script = render_sbatch(settings, run_dir, python=interpreter, workdir=workdir)
    files = JobFiles(run_dir, run_dir / CONFIG_FILE, run_dir / SCRIPT_FILE)
    lock = _run_lock(run_dir) if given else contextlib.nullcontext()  # a default dir was just claimed: new
    with lock:  # a live run's config.toml is never rewritten under it; refused before any write
        real_dir(run_dir / "logs")
        _atomic_write(files.config, to_toml(settings))
        _atomic_write(files.script, script, 0o755)
    return files


def _run_lock(run_dir: Path) -> contextlib.AbstractContextManager[object]:
    """The run directory's lock, held while its files are written (RunDirInUseError while a run holds it).

    `kforge resume RUN --sbatch` on a run that is training would otherwise replace its config.toml
    mid-run (imports the engine's lock module, which brings torch: only for an existing directory).
    """
    if not run_dir.is_dir():
        return contextlib.nullcontext()
    from kforge_cli.engine.train.run_lock import acquire_run_lock

    return acquire_run_lock(run_dir, wait_s=0)


def sbatch_from_cli(settings: JobSettings, *, submit: bool) -> int:
    """`--sbatch`: print the script (a dry run, no SLURM needed); `--submit`: submit it and print the job id."""
    files = write_job(settings)
    if not submit:
        typer.echo(files.script.read_text(), nl=False)
        typer.echo(f"wrote {files.script} and {files.config}; submit with: sbatch {files.script}", err=True)
        return EXIT_OK
    job_id = submit_script(files.script)
    typer.echo(f"submitted {files.script} as job {job_id}; logs in {files.run_dir / 'logs'}", err=True)
    typer.echo(job_id)
    return EXIT_OK
