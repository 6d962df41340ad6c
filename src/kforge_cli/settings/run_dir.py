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


def claim_default_run_dir(settings: JobSettings, base: Path | None = None) -> Path:
    """Create and return a fresh default run directory: runs/<profile>-<timestamp>[-N].

    ``mkdir`` without ``exist_ok`` is atomic, so two runs started in the same second get
    two directories (the second one ``-2``) instead of sharing one.
    """
    first = (base or Path.cwd()) / default_run_dir(settings)
    first.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = first if n == 1 else first.with_name(f"{first.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"no free run directory name next to {first}")


def checkpoint_root(settings: JobSettings, run_dir: Path) -> Path:
    """checkpoint.dir when set, else RUN_DIR/checkpoints."""
    if settings.checkpoint.dir:
        return Path(settings.checkpoint.dir).expanduser().resolve()
    return Path(run_dir) / "checkpoints"
