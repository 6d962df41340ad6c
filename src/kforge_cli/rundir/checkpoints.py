"""Checkpoint directories on disk: naming, the commit marker, `latest`, resolution, retention.

    CKPT_ROOT/                     (RUN_DIR/checkpoints unless checkpoint.dir)
      step_N/                      see :mod:`kforge_cli.rundir.names` for the files inside
      latest                       a one-line file naming the newest durable step dir

A checkpoint is *complete* only when ``kforge_commit.json`` exists and every DCP
directory it lists has its ``.metadata``. ``latest`` is a small text file replaced with
``os.replace`` after an fsync: rename is atomic on POSIX filesystems and on NFS/Lustre/GPFS,
and unlike a symlink it survives copying the run directory to object storage. Imports no torch.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
from pathlib import Path

from kforge_cli.common.files import atomic_write, open_regular
from kforge_cli.errors import CheckpointError, KforgeError
from kforge_cli.rundir.eval_records import pin_holds
from kforge_cli.rundir.names import CHECKPOINTS_DIR, COMMIT_FILE, DCP_METADATA, EVAL_PIN_FILE, LATEST_FILE

log = logging.getLogger("kforge")

_STEP_RE = re.compile(r"^step_(\d+)$")
_DCP_DIR_RE = re.compile(r"^pp_\d+$")
_TRASH_PREFIX = ".deleting-"


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file, fsync and rename (never through a planted link)."""
    atomic_write(path, data)


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON files are KBs; anything this large is not one of them


def _read_small(path: Path) -> bytes:
    """The bytes of a regular file of at most ``MAX_JSON_BYTES`` (a FIFO or device is refused, never read)."""
    with open_regular(path) as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
    return data


def read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(_read_small(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or not a kforge checkpoint") from None
    except (OSError, ValueError, RecursionError, KforgeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_N directory under `root`, oldest first.

    Only real directories count: a symlinked ``step_N`` is neither resumed from nor deleted
    by retention (deleting through it would remove files in the link's target).
    """
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_symlink():
            if step_of(p) is not None:
                log.warning("ignoring %s: it is a symbolic link; checkpoint directories must be real directories", p)
            continue
        if p.is_dir():
            found.append((step_of(p), p))
    return sorted((s, p) for s, p in found if s is not None)


def commit_problem(step_dir: Path) -> tuple[dict[str, object] | None, str | None]:
    """(the commit marker's content, None) when `step_dir` is complete, else (None, why not)."""
    marker = step_dir / COMMIT_FILE
    if step_dir.is_symlink():
        return None, f"{step_dir} is a symbolic link, not a checkpoint directory"
    try:
        record = json.loads(_read_small(marker))
    except FileNotFoundError:
        return None, f"{marker} is missing (the save never finished)"
    except (OSError, ValueError, RecursionError, KforgeError) as exc:
        return None, f"{marker} is not valid JSON ({exc})"
    if not isinstance(record, dict):
        return None, f"{marker} does not hold a JSON object"
    dirs = record.get("dcp_dirs", ["."])
    if not isinstance(dirs, list) or not dirs or not all(isinstance(d, str) for d in dirs):
        return None, f"{marker}: dcp_dirs is {dirs!r}, not a non-empty list of directory names"
    for d in dirs:
        if d != "." and not _DCP_DIR_RE.match(d):
            return None, f"{marker}: dcp_dirs names {d!r}; only '.' or pp_S directories inside the checkpoint count"
        sub = step_dir / d
        if d != "." and (sub.is_symlink() or not sub.is_dir()):
            return None, f"{sub} is not a directory inside the checkpoint"
        if not (sub / DCP_METADATA).is_file():
            return None, f"{sub / DCP_METADATA} is missing"
    return record, None


def commit_record(step_dir: Path) -> dict[str, object] | None:
    """The commit marker's content when `step_dir` is complete, else None."""
    return commit_problem(step_dir)[0]


def is_complete(step_dir: Path) -> bool:
    return commit_record(step_dir) is not None


def dcp_dirs(step_dir: Path) -> list[Path]:
    """The DCP directories of a complete checkpoint (the step dir itself, or one per pipeline stage)."""
    record, problem = commit_problem(step_dir)
    if record is None:
        raise CheckpointError(f"{step_dir} is not a complete checkpoint: {problem}")
    dirs = record.get("dcp_dirs", ["."])
    assert isinstance(dirs, list)  # commit_problem checked it: a non-empty list of directory names
    return [step_dir / d if d != "." else step_dir for d in dirs if isinstance(d, str)]


def read_latest(root: Path) -> Path | None:
    """The step dir `latest` names, if the file exists and names a step dir (anything else is ignored)."""
    try:
        name = _read_small(root / LATEST_FILE).decode("utf-8").strip()
    except (OSError, ValueError, KforgeError) as exc:
        if isinstance(exc, UnicodeDecodeError):
            log.warning("ignoring %s: it is not text (a damaged pointer)", root / LATEST_FILE)
        return None
    if not name:
        return None
    if step_of(Path(name)) is None or name != Path(name).name:
        log.warning("ignoring %s: it names %r, not a step_N directory of %s", root / LATEST_FILE, name[:80], root)
        return None
    return root / name


def write_latest(root: Path, step_dir: Path) -> None:
    atomic_write_bytes(root / LATEST_FILE, (step_dir.name + "\n").encode())


def newest_complete(root: Path) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint under `root`, and the newer incomplete ones skipped on the way."""
    skipped: list[Path] = []
    for _, path in reversed(list_step_dirs(root)):
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete step dir from a step dir, a checkpoints dir, or a run dir (its newest complete one)."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if (p / COMMIT_FILE).exists() or step_of(p) is not None:
        if not is_complete(p):
            raise CheckpointError(
                f"{p} is an incomplete checkpoint (its save never finished); use an earlier step_N or the run dir"
            )
        return p
    for root in (p / CHECKPOINTS_DIR, p):
        found, skipped = newest_complete(root)
        for s in skipped:
            log.warning("skipping incomplete checkpoint %s (its save never finished)", s)
        if found is not None:
            return found
    raise CheckpointError(f"no complete checkpoint under {p}: expected step_N directories holding {COMMIT_FILE}")


def remove_checkpoint(step_dir: Path) -> None:
    """Delete a step dir so that no reader ever sees it half-deleted but complete."""
    if step_dir.is_symlink():  # never delete through a link: drop the link only
        step_dir.unlink(missing_ok=True)
        return
    try:
        (step_dir / COMMIT_FILE).unlink(missing_ok=True)
        trash = step_dir.with_name(f"{_TRASH_PREFIX}{step_dir.name}-{secrets.token_hex(4)}")  # nothing planted there
        step_dir.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    except FileNotFoundError:
        pass


def prune(root: Path, keep_last_n: int, protect: set[Path]) -> list[Path]:
    """Apply retention; returns the deleted dirs.

    Keeps the newest `keep_last_n` complete checkpoints (0 = all), the `latest` target,
    everything in `protect` (an in-flight save) and every checkpoint a live evaluation pins
    (`rundir.eval_records.pin_holds`; a later prune deletes it once the evaluation ended).
    Incomplete dirs older than the newest complete one are leftovers of killed saves and are
    deleted too.
    """
    keep = {p.resolve() for p in protect}
    latest = read_latest(root)
    if latest is not None:
        keep.add(latest.resolve())
    entries = list_step_dirs(root)
    complete = [p for _, p in entries if is_complete(p)]
    if not complete:
        return []
    newest_step = step_of(complete[-1]) or 0
    doomed: list[Path] = []
    if keep_last_n > 0:
        doomed += complete[:-keep_last_n]
    doomed += [p for s, p in entries if s < newest_step and p not in complete]
    deleted = []
    for p in sorted(doomed):
        if p.resolve() in keep:
            continue
        if pin_holds(p):
            log.info("retention: keeping %s while an evaluation reads it (%s)", p, EVAL_PIN_FILE)
            continue
        remove_checkpoint(p)
        deleted.append(p)
    for leftover in root.glob(_TRASH_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return deleted


HF_CONFIG_FILE = "config.json"


def is_hf_dir(path: str | Path) -> bool:
    """A directory with ``config.json`` and safetensors weights (a Hugging Face model)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / HF_CONFIG_FILE).is_file() and any(p.glob("*.safetensors"))
