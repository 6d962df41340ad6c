"""A save that fails because the disk is full says so: ENOSPC, which path, and that nothing is lost.

DCP's writer reports a full disk as whatever its serializer raises (``RuntimeError:
unexpected pos ...`` from torch's zip writer, ``OSError: [Errno 28]`` elsewhere), wrapped
in DCP's ``CheckpointException``. A failed save never wrote its commit marker, so the
previous checkpoint is still the one resume and ``latest`` use; the error says that.
"""

from __future__ import annotations

import errno
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from kforge_cli.errors import KforgeError
from kforge_cli.rundir.checkpoints import read_latest

LOW_FREE_BYTES = 64 * 2**20  # an opaque write error with less than this free is a full disk


class DiskFullError(KforgeError):
    """The filesystem of a checkpoint ran out of space during a save (exit 1: free space, then resume)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]
        for failure in getattr(e, "failures", {}).values():  # DCP's CheckpointException: per-rank failures
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                stack.append(inner)


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def is_disk_full(exc: BaseException, path: Path) -> bool:
    if _full(exc):
        return True
    free = _free_bytes(path)
    return free is not None and free < LOW_FREE_BYTES


def _full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _chain(exc))


def _quiet_writer_threads() -> None:
    """DCP's writer threads (``_write_files_from_queue``) die of the ENOSPC themselves, and Python prints
    their traceback before the saving thread reports it: keep that one quiet (the saving thread raises
    :class:`DiskFullError` with the whole story). Any other thread exception is printed as before."""
    previous = threading.excepthook
    if getattr(previous, "kforge_disk_full", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        name = getattr(args.thread, "name", "") or ""
        if args.exc_value is not None and "_write_files_from_queue" in name and _full(args.exc_value):
            return
        previous(args)

    hook.kforge_disk_full = True  # type: ignore[attr-defined]
    threading.excepthook = hook


@contextmanager
def disk_full_explained(step_dir: Path, root: Path) -> Iterator[None]:
    """Re-raise a save failure caused by a full disk as :class:`DiskFullError` naming the path."""
    _quiet_writer_threads()
    try:
        yield
    except KforgeError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
        if not is_disk_full(exc, step_dir):
            raise
        free = _free_bytes(step_dir)
        latest = read_latest(root)
        kept = f"the previous checkpoint {latest} is intact and stays latest" if latest else "no earlier checkpoint"
        raise DiskFullError(
            f"disk full (ENOSPC) while saving checkpoint {step_dir} ({free if free is not None else '?'} bytes "
            f"free): {kept}. Free space (or lower checkpoint.keep_last_n / set checkpoint.dir elsewhere) and resume"
        ) from exc
