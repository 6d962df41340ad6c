"""Where a run's files go: the default run directory and the checkpoint root (one rule each).

Torch-free, so `kforge train`, `--sbatch`, `kforge resume` and the engine all name a run
the same way.
"""

from __future__ import annotations

import time
from pathlib import Path

from kforge_cli.settings.job import JobSettings

RUNS_DIR = Path("runs")


def run_name(settings: JobSettings) -> str:
    """The profile's name (a profile given as a path: its file's stem), or 'custom'."""
    return Path(settings.profile).stem if settings.profile else "custom"


def default_run_dir(settings: JobSettings) -> Path:
    """runs/<profile>-<timestamp> (relative: resolved against the working directory)."""
    return RUNS_DIR / f"{run_name(settings)}-{time.strftime('%Y%m%d-%H%M%S')}"


def checkpoint_root(settings: JobSettings, run_dir: Path) -> Path:
    """checkpoint.dir when set, else RUN_DIR/checkpoints."""
    if settings.checkpoint.dir:
        return Path(settings.checkpoint.dir).expanduser().resolve()
    return Path(run_dir) / "checkpoints"
