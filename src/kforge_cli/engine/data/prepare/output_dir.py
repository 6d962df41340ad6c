"""prepare-data's output directory: what may be replaced, and how it is published whole.

Everything is written to a hidden temporary directory next to ``--out``; every file and
directory in it is fsynced, then one rename publishes it (an older prepared directory is
moved aside first and removed after). SIGTERM and Ctrl-C remove the temporary directory;
only a directory prepare-data itself wrote (its format marker) is ever replaced.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from kforge_cli.common.files import fsync_dir
from kforge_cli.engine.data.shards import FORMAT, METADATA
from kforge_cli.errors import InvalidInputError


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing an older prepared directory.

    SIGTERM is held back for the two renames (delivered right after): a stop between them
    would otherwise leave neither the old directory nor the new one at ``out``.
    """
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        if out.exists():
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if in_main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def check_out(out: Path, *, overwrite: bool = False) -> None:
    """`out` may be missing, empty, or (with `overwrite`) a directory prepare-data wrote (its format
    marker); nothing else is replaced. Called only when `out` is not up to date with the inputs: a
    prepared directory there holds other data, which a run may be training on."""
    if out.is_symlink():
        raise InvalidInputError(f"--out {out} is a symbolic link: pass the real directory (or a new path)")
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"--out {out} is a file, not a directory: choose another path")
    if not out.exists() or not any(out.iterdir()):
        return
    try:
        marker = json.loads((out / METADATA).read_text(encoding="utf-8")).get("format")
    except (OSError, ValueError, AttributeError):
        marker = None
    if marker != FORMAT:
        raise InvalidInputError(
            f"--out {out} exists and was not written by `kforge prepare-data` (no {METADATA} with format "
            f"{FORMAT!r}): refusing to replace it. Choose another path, or remove it yourself"
        )
    if not overwrite:
        raise InvalidInputError(
            f"--out {out} holds data prepared from other inputs or options (its {METADATA} does not match these): "
            "refusing to replace it. Pass --overwrite to replace it (a run trained on it then refuses to resume "
            "on the new data unless you allow it), or choose another --out"
        )


def fsync_tree(root: Path) -> None:
    """Every file and directory under `root` durable before the final rename publishes it."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def sigterm_cleans_up() -> Callable[[], None]:
    """Turn SIGTERM into SystemExit(143) so `finally` removes the temporary directory; returns the undo.

    `kforge prepare-data` stopped by SIGTERM exits 143 (128 + 15) and leaves ``--out`` as it
    was (no temporary directory, no half-written output); Ctrl-C does the same with exit 130.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)

    return undo
