"""Where a run's files go: the default run directory, which directories are runs, the checkpoint root.

One rule each, torch-free, so `kforge train`, `--sbatch`, `kforge resume` and the engine all
name, claim and recognise a run directory the same way.
"""

from __future__ import annotations

import time
from pathlib import Path

from kforge_cli.errors import InvalidInputError
from kforge_cli.files import SymlinkRefusedError, read_toml_file
from kforge_cli.settings.job import JobSettings

RUNS_DIR = Path("runs")
CHECKPOINTS_DIR = "checkpoints"
LOCK_FILE = ".kforge-lock"
_KFORGE_ENTRIES = (CHECKPOINTS_DIR, "metrics.jsonl", "logs", "job.sbatch", LOCK_FILE)


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


def is_kforge_run(run_dir: Path) -> bool:
    """True when `run_dir` holds something kforge writes (a config with model/train tables, logs, checkpoints)."""
    if any((run_dir / name).exists() or (run_dir / name).is_symlink() for name in _KFORGE_ENTRIES):
        return True
    try:
        config = read_toml_file(run_dir / "config.toml")
    except InvalidInputError:
        return False
    return isinstance(config.get("model"), dict) and isinstance(config.get("train"), dict)


def refuse_foreign_dir(run_dir: Path) -> None:
    """Refuse an existing, non-empty directory that is not a kforge run (it would be written into)."""
    if run_dir.is_dir() and any(run_dir.iterdir()) and not is_kforge_run(run_dir):
        raise InvalidInputError(
            f"{run_dir} exists, is not empty and is not a kforge run directory (no config.toml, logs/ or "
            "checkpoints/ written by kforge): refusing to write into it. Pass a new or empty --run-dir"
        )


def checkpoint_root(settings: JobSettings, run_dir: Path) -> Path:
    """checkpoint.dir when set (the user's explicit choice, links resolved), else RUN_DIR/checkpoints.

    The default root must be a real directory inside the run (or not exist yet): a
    ``checkpoints`` link would make retention delete, and resume read, wherever it points,
    so it is refused (exit 2) before anything is read or written through it.
    """
    if settings.checkpoint.dir:
        return Path(settings.checkpoint.dir).expanduser().resolve()
    root = Path(run_dir) / CHECKPOINTS_DIR
    if root.is_symlink():
        raise SymlinkRefusedError(
            f"{root} is a symbolic link (to {_link_target(root)}); kforge keeps a run's checkpoints in a real "
            "directory inside the run and never reads, writes or deletes through a link. Replace the link with "
            "the directory itself, or set --checkpoint.dir to the real location"
        )
    if root.exists() and not root.is_dir():
        raise InvalidInputError(f"{root} is a file, not the run's checkpoint directory: move it away")
    return root


def _link_target(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return "?"
