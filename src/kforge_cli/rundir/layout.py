"""Where a run's files go: :class:`RunDir`, the default run directory, which directories are runs.

One rule each, torch-free, so `kforge train`, `--sbatch`, `kforge resume`, `kforge runs` and
the engine all name, claim and recognise a run directory the same way. The file names
themselves live in :mod:`kforge_cli.rundir.names`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import SymlinkRefusedError, read_toml_file
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir import names
from kforge_cli.rundir.checkpoints import step_of

if TYPE_CHECKING:  # the settings (pydantic) load only where they are used: `kforge runs` never needs them
    from kforge_cli.settings.job import JobSettings

RUNS_DIR = Path("runs")
MAX_DATA_NAME = 40  # characters of the data's name in a default run directory
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")

# What kforge writes into a run directory (any one of them makes it a kforge run) ...
_RUN_ENTRIES = (
    names.CHECKPOINTS_DIR,
    names.METRICS_FILE,
    names.LOGS_DIR,
    names.JOB_SCRIPT,
    names.LOCK_FILE,
    names.CONFIG_CHANGES_FILE,
)
# ... and into a checkpoint directory or a checkpoint root.
_CHECKPOINT_ENTRIES = (names.COMMIT_FILE, names.TRAIN_STATE_FILE, names.DCP_METADATA, names.LATEST_FILE)


@dataclass(frozen=True)
class RunDir:
    """A run directory and the path of everything kforge keeps in it."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of_checkpoint(cls, step_dir: Path) -> RunDir | None:
        """The run holding `step_dir` when it sits in RUN_DIR/checkpoints, else None (checkpoint.dir elsewhere)."""
        step_dir = Path(step_dir)
        return cls(step_dir.parent.parent) if step_dir.parent.name == names.CHECKPOINTS_DIR else None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> Path:
        return self.path / names.CONFIG_FILE

    @property
    def config_changes(self) -> Path:
        return self.path / names.CONFIG_CHANGES_FILE

    @property
    def data_positions(self) -> Path:
        return self.path / names.DATA_POSITIONS_FILE

    @property
    def metrics(self) -> Path:
        return self.path / names.METRICS_FILE

    @property
    def logs(self) -> Path:
        return self.path / names.LOGS_DIR

    @property
    def checkpoints(self) -> Path:
        """RUN_DIR/checkpoints (the root unless checkpoint.dir says otherwise: see :meth:`checkpoint_root`)."""
        return self.path / names.CHECKPOINTS_DIR

    @property
    def tokenizer(self) -> Path:
        return self.path / names.TOKENIZER_FILE

    @property
    def job_script(self) -> Path:
        return self.path / names.JOB_SCRIPT

    @property
    def slurm_jobs(self) -> Path:
        return self.path / names.SLURM_JOBS_FILE

    @property
    def eval_dir(self) -> Path:
        return self.path / names.EVAL_DIR

    @property
    def profile_dir(self) -> Path:
        return self.path / names.PROFILE_DIR

    @property
    def memory_dir(self) -> Path:
        return self.path / names.MEMORY_DIR

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / names.TENSORBOARD_DIR

    @property
    def lock_file(self) -> Path:
        return self.path / names.LOCK_FILE

    @property
    def launch_file(self) -> Path:
        return self.path / names.LAUNCH_FILE

    @property
    def exit_file(self) -> Path:
        return self.path / names.EXIT_FILE

    def slurm_log(self, job_id: str = "%j") -> Path:
        """logs/slurm-JOBID.out (``%j``: the pattern sbatch fills in)."""
        return self.logs / f"slurm-{job_id}.out"

    def has_config(self) -> bool:
        """True when config.toml is there (a file, not a link): the run has started."""
        return self.config.is_file() and not self.config.is_symlink()

    def kforge_marker(self) -> str | None:
        """The first thing in this directory that kforge writes into a run (None: not a kforge run)."""
        for name in _RUN_ENTRIES:
            entry = self.path / name
            if entry.exists() or entry.is_symlink():
                return name
        try:
            config = read_toml_file(self.config)  # capped; a FIFO or device is refused, never read
        except InvalidInputError:
            return None
        if isinstance(config.get("model"), dict) and isinstance(config.get("train"), dict):
            return names.CONFIG_FILE
        return None

    def is_kforge_run(self) -> bool:
        """True when the directory holds something kforge writes (a config with model/train tables, logs, ...)."""
        return self.kforge_marker() is not None

    def refuse_foreign(self) -> None:
        """Refuse an existing, non-empty directory that is not a kforge run (it would be written into)."""
        if self.path.is_dir() and any(self.path.iterdir()) and not self.is_kforge_run():
            raise InvalidInputError(
                f"{self.path} exists, is not empty and is not a kforge run directory (no {names.CONFIG_FILE}, "
                f"{names.LOGS_DIR}/ or {names.CHECKPOINTS_DIR}/ written by kforge): refusing to write into it. "
                "Pass a new or empty --run-dir"
            )

    def checkpoint_root(self, settings: JobSettings) -> Path:
        """checkpoint.dir when set (the user's explicit choice, links resolved), else RUN_DIR/checkpoints.

        The default root must be a real directory inside the run (or not exist yet): a
        ``checkpoints`` link would make retention delete, and resume read, wherever it points,
        so it is refused (exit 2) before anything is read or written through it.
        """
        if settings.checkpoint.dir:
            return Path(settings.checkpoint.dir).expanduser().resolve()
        root = self.checkpoints
        if root.is_symlink():
            raise SymlinkRefusedError(
                f"{root} is a symbolic link (to {_link_target(root)}); kforge keeps a run's checkpoints in a real "
                "directory inside the run and never reads, writes or deletes through a link. Replace the link with "
                "the directory itself, or set --checkpoint.dir to the real location"
            )
        if root.exists() and not root.is_dir():
            raise InvalidInputError(f"{root} is a file, not the run's checkpoint directory: move it away")
        return root


def kforge_contents(path: Path) -> str | None:
    """What in `path` makes it a kforge run or checkpoint (never to be wiped by an export), else None."""
    path = Path(path)
    for name in _CHECKPOINT_ENTRIES:
        if (path / name).exists():
            return name
    marker = RunDir(path).kforge_marker()
    if marker is not None:
        return marker
    if path.is_dir() and any(step_of(p) is not None for p in path.iterdir()):
        return "step_N checkpoint directories"
    return None


def data_name(settings: JobSettings) -> str | None:
    """The training data's short name: data.path's directory name, a mixture's dataset names joined
    with '+' (the first three, then '+N'), the VLM data directory's name; None for a built-in corpus."""
    if settings.vlm is not None:
        names_ = [Path(settings.vlm.data_path).name] if settings.vlm.data_path else []
    elif settings.data.datasets:
        names_ = [d.name for d in settings.data.datasets]
        names_ = [*names_[:3], f"{len(names_) - 3}more"] if len(names_) > 3 else names_
    else:
        names_ = [Path(settings.data.path).name] if settings.data.path else []
    cleaned = [_NAME_UNSAFE.sub("-", n).strip("-.") for n in names_]
    text = "+".join(n for n in cleaned if n)[:MAX_DATA_NAME]
    return text or None


def run_name(settings: JobSettings) -> str:
    """<profile>-<data>: the profile's name (a profile given as a path: its file's stem, else 'custom'),
    then the data's name (none for the built-in corpus), so runs on different data differ at a glance."""
    profile = Path(settings.profile).stem if settings.profile else "custom"
    data = data_name(settings)
    return f"{profile}-{data}" if data else profile


def default_run_dir(settings: JobSettings) -> Path:
    """runs/<profile>[-<data>]-<timestamp> (relative: resolved against the working directory)."""
    return RUNS_DIR / f"{run_name(settings)}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_default_run_dir(settings: JobSettings, base: Path | None = None) -> Path:
    """Create and return a fresh default run directory: runs/<profile>[-<data>]-<timestamp>[-N].

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


def _link_target(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return "?"
