"""Starting a run's processes on this node (`kforge train/resume --nproc-per-node`), shared by both
commands; no torch at import."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from kforge_cli.settings.config_layers import ResolvedSettings


def run_processes(run_dir: Path) -> int | None:
    """The run's own `--nproc-per-node` (RUN_DIR/launch.json) for a command that typed none, when
    this process is not itself a rank of a launched job (torchrun, srun)."""
    from kforge_cli.rundir.launch import launched, recorded_local_nproc

    return None if launched() else recorded_local_nproc(run_dir)


def launch_local_job(resolved: ResolvedSettings, nproc: int, child: list[str]) -> int:
    """Check the settings fit `nproc` processes, then start them, each running ``kforge <child>``."""
    from kforge_cli.settings.shrink import check_world

    if nproc < 1:
        raise typer.BadParameter("--nproc-per-node must be at least 1")
    check_world(resolved.settings, nproc)  # a ConfigError here beats N processes each printing it
    from kforge_cli.engine.runtime.local_launch import launch_local

    code = launch_local(nproc, child)
    from kforge_cli.cli.outcome import record_job_exit

    record_job_exit(resolved.settings, code)  # the job's code, over rank 0's own
    return code
