"""The files of an evaluation per checkpoint (``eval.after_checkpoint``): the pin and the status. No torch.

    step_N/kforge_eval_pin.json    an evaluation holds this checkpoint: retention keeps it
    RUN_DIR/eval/step_N.status.json  running / done / failed, with the process, times and any error

The pin names its holder (pid, host, and the SLURM job when there is one). It holds while that
process lives: on this host a pin whose pid is gone (a killed evaluation) holds nothing, so a
dead evaluation never pins a checkpoint forever; a pin written on another host (a SLURM job on
another node) holds for ``PIN_MAX_AGE_S`` at most. Every file here is written whole
(``common.files.atomic_write``); the status of a step is written by one process at a time: the
training when it starts the evaluation (and when it sees the process die), then the evaluation.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.common.files import atomic_write, read_text_capped, real_dir
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.names import EVAL_DIR, EVAL_PIN_FILE, EVAL_STATUS_SUFFIX

PIN_MAX_AGE_S = 24 * 3600.0  # a pin from another host (whose process cannot be asked) holds at most this long
_MAX_RECORD = 1 << 20
STATES = ("running", "done", "failed")


def this_host() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, dead but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: the signal probe said it exists
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _read(path: Path) -> dict[str, object] | None:
    try:
        record = json.loads(read_text_capped(path, _MAX_RECORD, "evaluation record", follow_links=False))
    except (OSError, ValueError, RecursionError, KforgeError):
        return None
    return record if isinstance(record, dict) else None


def _write(path: Path, record: dict[str, object]) -> None:
    """Whole or not at all, without fsync: these records are advisory (a machine crash ends the
    processes they describe) and the training's loop writes them."""
    atomic_write(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode(), durable=False)


# ---- the pin ----------------------------------------------------------------------------


def write_pin(step_dir: Path, pid: int, *, slurm_job: str | None = None) -> None:
    """Pin ``step_dir`` for process ``pid`` of this host (replacing an earlier pin)."""
    record: dict[str, object] = {"pid": pid, "host": this_host(), "time": time.time()}
    if slurm_job:
        record["slurm_job"] = slurm_job
    _write(step_dir / EVAL_PIN_FILE, record)


def remove_pin(step_dir: Path) -> None:
    (step_dir / EVAL_PIN_FILE).unlink(missing_ok=True)


def pin_holds(step_dir: Path, now: float | None = None) -> bool:
    """Whether a live evaluation pins ``step_dir`` (see the module docstring for a stale pin)."""
    path = step_dir / EVAL_PIN_FILE
    if not path.exists():
        return False
    record = _read(path)
    if record is None:
        return False  # unreadable: not a pin kforge wrote
    pid, host, made = record.get("pid"), record.get("host"), record.get("time")
    if host == this_host():
        return isinstance(pid, int) and not isinstance(pid, bool) and pid_alive(pid)
    now = time.time() if now is None else now
    return isinstance(made, (int, float)) and now - float(made) < PIN_MAX_AGE_S


# ---- the status -------------------------------------------------------------------------


def status_path(run_dir: Path, step: int) -> Path:
    return run_dir / EVAL_DIR / f"step_{step}{EVAL_STATUS_SUFFIX}"


def write_status(run_dir: Path, step: int, record: dict[str, object]) -> None:
    real_dir(run_dir / EVAL_DIR)  # never through a planted link
    _write(status_path(run_dir, step), {"step": step, **record})


def read_status(run_dir: Path, step: int) -> dict[str, object] | None:
    return _read(status_path(run_dir, step))


def effective_state(record: dict[str, object]) -> str:
    """running / done / failed; a 'running' evaluation whose process is gone from this host failed."""
    state = record.get("state")
    if state not in STATES:
        return "failed"
    if state != "running" or record.get("host") != this_host() or record.get("slurm_job"):
        return str(state)
    pid, launcher = record.get("pid"), record.get("launched_by")
    holder = pid if pid is not None else launcher  # not started yet: its launcher still holds it
    if isinstance(holder, int) and not isinstance(holder, bool) and not pid_alive(holder):
        return "failed"
    return str(state)


@dataclass(frozen=True)
class EvalCounts:
    done: int = 0
    running: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return self.done + self.running + self.failed

    def cell(self) -> str:
        """``done/running/failed``, the ``kforge runs`` column."""
        return f"{self.done}/{self.running}/{self.failed}"


def eval_counts(run_dir: Path) -> EvalCounts:
    """How the run's evaluations per checkpoint stand, from their status files."""
    folder = run_dir / EVAL_DIR
    if folder.is_symlink() or not folder.is_dir():
        return EvalCounts()
    tally: dict[str, int] = dict.fromkeys(STATES, 0)
    for path in folder.glob(f"step_*{EVAL_STATUS_SUFFIX}"):
        record = _read(path)
        tally[effective_state(record) if record is not None else "failed"] += 1
    return EvalCounts(tally["done"], tally["running"], tally["failed"])
