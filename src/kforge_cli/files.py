"""Writing into a run directory without following symbolic links.

Run directories are shared and copied between people. A ``logs/rank_0.log`` that is a
link to ``~/.ssh/authorized_keys``, or a planted ``config.toml.tmp`` link, would make a
plain ``open(path, "a")`` write wherever the link points. Every file kforge writes in a
run directory goes through here: the last component is opened with ``O_NOFOLLOW`` (a link
is refused, naming it), temporary files are created with ``O_EXCL`` (a planted one is
never written through) and directories kforge creates must be real directories.
Imports nothing heavy.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO

from kforge_cli.errors import InvalidInputError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class SymlinkRefusedError(InvalidInputError):
    """A path kforge would write is a symbolic link (exit 2): it names the link and its target."""


def _refuse(path: Path, what: str = "file") -> SymlinkRefusedError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return SymlinkRefusedError(
        f"refusing to write {path}: this {what} is a symbolic link (to {target}), and kforge never writes through "
        "a link in a run directory. Remove the link, or use another run directory"
    )


def check_run_dir(path: Path) -> Path:
    """`path` as a run directory: missing (it will be made) or a directory, never a file."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidInputError(f"run directory {path} is a file, not a directory: pass a directory to --run-dir")
    return path


def real_dir(path: Path) -> Path:
    """Create `path` (and parents) if needed; refuse when it is a symbolic link or not a directory."""
    path = Path(path)
    if path.is_symlink():
        raise _refuse(path, "directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InvalidInputError(f"{path} exists and is not a directory") from None
    except NotADirectoryError:
        raise InvalidInputError(f"cannot create {path}: a component of it is a file, not a directory") from None
    if path.is_symlink():  # lost a race with whoever made it a link
        raise _refuse(path, "directory")
    return path


def _open_fd(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) or (exc.errno == errno.EEXIST and path.is_symlink()):
            raise _refuse(path) from None
        raise


def open_append(path: Path, encoding: str = "utf-8") -> IO[str]:
    """`path` opened for appending text, created if missing; a symbolic link is refused."""
    fd = _open_fd(Path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return os.fdopen(fd, "a", encoding=encoding)


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` via a fresh temporary file, fsync and rename: readers see all or nothing.

    The temporary file is created exclusively (a file or link already at its name is
    removed first and never written through); the rename replaces `path` itself, so a link
    at `path` is replaced, not followed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    fd = _open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
