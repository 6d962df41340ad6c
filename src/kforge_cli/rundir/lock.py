"""One run per run directory: an exclusive lock for the life of a run, and no foreign directories.

Two `kforge train` on one directory would interleave ``metrics.jsonl`` and delete each
other's checkpoints in flight. Rank 0 holds ``fcntl.flock`` on ``RUN_DIR/.kforge-lock``
while the run lives; the kernel releases it on any exit, including ``kill -9``, so a lock
left by a dead process is simply taken over (its record is logged). A SLURM job that was
requeued may start before the filesystem noticed the old node's process died (NFS lock
leases): then it waits a while for the lock instead of failing at once. Where the
filesystem has no ``flock`` (some Lustre mounts), the record alone decides: a live process
on this host blocks, anything else is taken over with a warning.

Whether a run lives is asked without taking its lock (:func:`probe_run_lock`): even a shared
lock held for an instant could make a run that starts at that moment fail "in use". The
kernel's table of held locks (``/proc/locks``) answers for this host; a holder on another host
(a SLURM node) or a filesystem without ``flock`` cannot be seen, and the caller falls back to
the run's records.

A directory that exists, is not empty and holds nothing kforge wrote is refused rather
than written into: that rule is :meth:`RunDir.refuse_foreign
<kforge_cli.rundir.layout.RunDir.refuse_foreign>`, so `--sbatch` applies it too.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TypedDict

from kforge_cli.common.files import open_append
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.layout import RunDir

log = logging.getLogger("kforge")

REQUEUE_WAIT_S = 120.0  # how long a requeued SLURM job waits for the old holder's lock to expire
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirInUseError(InvalidInputError):
    """Another live kforge process holds the run directory (exit 2)."""


class LockRecord(TypedDict):
    """What the lock file says about its holder (read back by the next claimant, untrusted)."""

    pid: int
    host: str
    slurm_job_id: str | None
    since: str


def _record() -> LockRecord:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _read_record(path: Path) -> dict[str, object]:
    try:
        data: object = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _alive_here(record: Mapping[str, object]) -> bool:
    """The record's process runs on this host (a record from another host cannot be checked)."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(record: Mapping[str, object]) -> str:
    job = f", SLURM job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}{job}, since {record.get('since', '?')}"


class RunLock:
    """The held lock of one run directory (rank 0 only); `release` (or process exit) frees it."""

    def __init__(self, run_dir: Path, handle: IO[str]) -> None:
        self.run_dir, self._handle = run_dir, handle

    def release(self) -> None:
        if self._handle.closed:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
        self._handle.close()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _requeued(previous: Mapping[str, object]) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    restarted = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    return bool(job) and (restarted or previous.get("slurm_job_id") == job)


def acquire_run_lock(run_dir: Path, *, wait_s: float | None = None) -> RunLock:
    """Take the exclusive lock of `run_dir` or raise :class:`RunDirInUseError` naming the holder."""
    path = RunDir(run_dir).lock_file
    previous = _read_record(path)
    handle = open_append(path)  # never through a planted link
    deadline = time.monotonic() + (wait_s if wait_s is not None else REQUEUE_WAIT_S if _requeued(previous) else 0)
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            handle.close()
            raise RunDirInUseError(
                f"{run_dir} is in use by another kforge run ({_describe(_read_record(path))}); wait for it to end, "
                "or use another --run-dir. Two runs in one directory would mix their metrics and checkpoints"
            ) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            if _alive_here(previous):
                handle.close()
                raise RunDirInUseError(f"{run_dir} is in use by {_describe(previous)} (no flock here)") from None
            log.warning("%s: the filesystem has no flock; relying on the lock file's record alone", run_dir)
            break
    if previous.get("pid") is not None and previous.get("pid") != os.getpid():
        log.info("run dir lock: taking over from %s, which is no longer running", _describe(previous))
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(_record()) + "\n")
    handle.flush()
    return RunLock(run_dir, handle)


PROC_LOCKS = Path("/proc/locks")


def _held_inodes(table: str) -> set[tuple[str, int]]:
    """(device, inode) of every lock in a /proc/locks text (device as printed: ``fe:00``)."""
    held = set()
    for line in table.splitlines():
        for field in line.split():
            parts = field.split(":")
            if len(parts) == 3 and parts[2].isdigit():
                held.add((f"{parts[0]}:{parts[1]}", int(parts[2])))
                break
    return held


def probe_run_lock(run_dir: Path, *, proc_locks: Path = PROC_LOCKS) -> bool | None:
    """Whether a live kforge process holds `run_dir`'s lock, never taking it (see the module docstring).

    True: held; False: free (no lock file, or its holder ran on this host and holds nothing
    now); None: cannot tell from here (the holder's host is another one, or this system shows no
    lock table), so the caller decides from the run's records.
    """
    path = RunDir(run_dir).lock_file
    try:
        inode = path.stat().st_ino
    except FileNotFoundError:
        return False
    except OSError:
        return None
    record = _read_record(path)
    if record.get("host") not in (None, socket.gethostname()):
        return None  # its holder ran elsewhere: this host's lock table cannot see it
    try:
        table = proc_locks.read_text()
    except OSError:
        return _alive_here(record) if record else None  # no lock table: the record's process, if any
    if any(ino == inode for _, ino in _held_inodes(table)):
        return True
    if record and record.get("host") is None:
        return None
    return False


def refuse_in_use(run_dir: Path) -> None:
    """Raise :class:`RunDirInUseError` when a live process holds `run_dir`'s lock (probed, not taken).

    The command that starts a job calls it before anything slow (torch) is imported; the job's
    rank 0 still takes the lock itself (a run may start in between)."""
    if probe_run_lock(run_dir):
        raise RunDirInUseError(
            f"{run_dir} is in use by another kforge run ({_describe(_read_record(RunDir(run_dir).lock_file))}); "
            "wait for it to end, or use another --run-dir. Two runs in one directory would mix their metrics and "
            "checkpoints"
        )
