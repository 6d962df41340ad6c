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
import secrets
import shutil
import stat
import tempfile
import tomllib
from collections.abc import Callable
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


def _unique_temp(path: Path) -> tuple[Path, int]:
    """A new file next to `path` under a name nobody can predict, created exclusively: (its path, an fd)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            return tmp, _open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            continue
    raise InvalidInputError(f"cannot create a temporary file next to {path}: every name tried exists")


def atomic_write(path: Path, data: bytes, mode: int | None = None, *, durable: bool = True) -> None:
    """Write `data` to `path` via a fresh temporary file, fsync and rename: readers see all or nothing.

    The temporary file has an unpredictable name and is created exclusively (nothing
    planted can be at its name); the rename replaces `path` itself, so a link at `path`
    is replaced, not followed. ``durable=False`` skips the fsyncs (milliseconds each on a busy
    disk): readers still see all or nothing, a crash of the machine may lose the write.
    """
    path = Path(path)
    tmp, fd = _unique_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_via(path: Path, write: Callable[[Path], object], mode: int | None = 0o644) -> None:
    """Let `write(tmp)` produce a file a library writes by name (matplotlib, the profiler, safetensors,
    a copy), then move it onto `path` atomically.

    ``tmp`` lies in a private directory kforge has just created next to `path` (mode 0700,
    unpredictable name), so nothing can be planted at it; a link at `path` is replaced, not followed.
    """
    path = Path(path)
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp = private / path.name
    try:
        write(tmp)
        if tmp.is_symlink() or not tmp.is_file():
            raise InvalidInputError(f"writing {path} produced no regular file")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    fsync_dir(path.parent)


def copy_file_atomic(source: Path, path: Path, max_bytes: int | None = None) -> None:
    """Copy the regular file `source` to `path` through :func:`atomic_write` (a link at either end is refused)."""
    source = Path(source)
    if source.is_symlink() or not source.is_file():
        raise InvalidInputError(f"{source} is not a regular file (a link or something else); refusing to copy it")
    size = source.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise InvalidInputError(f"{source} is {size} bytes, more than the {max_bytes} kforge copies")
    fd = _open_read(source)
    with os.fdopen(fd, "rb") as f:
        data = f.read(size + 1 if max_bytes is None else max_bytes + 1)
    atomic_write(path, data)


def _open_read(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise InvalidInputError(f"{path} is a symbolic link; refusing to read through it") from None
        raise


def output_dir(path: Path | str, what: str) -> Path:
    """An output directory argument, absolute but not resolved: a symbolic link there is refused.

    Resolving it would write (and, when replacing, delete) wherever the link points.
    """
    out = Path(os.path.abspath(Path(path).expanduser()))
    if out.is_symlink():
        raise _refuse(out, f"{what} directory")
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"{out} is a file, not a directory: choose another {what} directory")
    return out


def private_dir_beside(out: Path) -> Path:
    """A new, private (0700), unpredictably named directory next to `out`: nothing can be planted in it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def swap_in(tmp: Path, out: Path) -> None:
    """Publish the finished directory `tmp` at `out`; an existing `out` (already checked) is moved aside, then removed.

    `tmp` (from :func:`private_dir_beside`) gets the permissions a plain ``mkdir`` would have given it.
    """
    mask = os.umask(0)
    os.umask(mask)
    tmp.chmod(0o777 & ~mask)
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{secrets.token_hex(6)}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def open_regular(path: Path | str, follow_links: bool = True) -> IO[bytes]:
    """`path` opened for reading in binary, only if it is a regular file.

    A FIFO (which would block forever), a device (``/dev/zero``: endless) or a directory
    is refused (exit 2) before anything is read; the open itself never blocks. With
    ``follow_links=False`` a symbolic link at `path` is refused too (a file kforge wrote
    itself in a run directory is never a link).
    """
    path = Path(path)
    if not follow_links:
        fd = _open_read(path)
    else:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidInputError(f"{path} is not a regular file (a FIFO, device or directory); refusing to read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text_capped(path: Path | str, max_bytes: int, what: str = "file", follow_links: bool = True) -> str:
    """The UTF-8 text of the regular file `path`, refused (exit 2) beyond `max_bytes` or when not UTF-8
    (and, with ``follow_links=False``, when `path` is a symbolic link)."""
    with open_regular(path, follow_links=follow_links) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidInputError(f"{what} {path} is larger than {max_bytes} bytes: not a file kforge wrote")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


MAX_TOML_BYTES = 4 << 20  # a settings file is KBs
MAX_METADATA_BYTES = 64 << 20  # a prepared directory's metadata.json: KBs, MBs with many thousands of shards


def read_toml_file(path: Path | str, what: str = "config") -> dict[str, object]:
    """A TOML file as a dict; every way the file can be wrong is an InvalidInputError naming it (exit 2).

    Missing (the message says so), a FIFO or device (refused, never read), over
    ``MAX_TOML_BYTES``, not UTF-8, not TOML, nested too deeply or holding a number too long
    to convert: never a hang, never a traceback.
    """
    path = Path(path)
    try:
        text = read_text_capped(path, MAX_TOML_BYTES, what)
    except FileNotFoundError:
        raise InvalidInputError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{what} {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise InvalidInputError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"{what} {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise InvalidInputError(f"{what} {path} is not valid TOML: it is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InvalidInputError(f"{what} {path} is not valid TOML: {exc}") from None


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
