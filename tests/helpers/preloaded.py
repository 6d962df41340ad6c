"""A process that has imported torch and kforge once and forks a fresh-looking process per command.

Started by ``tests.helpers.launch`` (``python -m tests.helpers.preloaded SOCKET``); not a test.
Starting Python and importing torch + kforge costs ~3 s of CPU, 90% of a tiny ``kforge train``
on the test machines; a fork of this process costs ~20 ms. Each command still runs in its own
process: real exit codes, signals, environment, working directory and stdio, and a normal
interpreter exit (atexit handlers, non-daemon threads joined).

Protocol, one UNIX-socket connection per command: the client sends an 8-byte length with
three file descriptors (stdin, stdout, stderr of the command), then that many bytes of JSON
(``{"kind": "kforge" | "call", "args": [...], "target": "module:function", "env": {...},
"cwd": "..."}``). The server forks a waiter, which forks the command and writes
``pid N\\n`` and later ``exit CODE\\n`` (CODE as ``Popen.returncode``: -N for signal N).
The server exits when its stdin (a pipe from the test process) closes.

What differs from a fresh interpreter: modules imported here are not imported again (their
import-time reads of the environment saw the server's), kforge's in-process cache of the
built-in corpus is already filled, and all commands of one server share its hash seed
(``tests.helpers.launch`` starts one server per rank index so that ranks differ).
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import types
from typing import Any

# What `kforge train` and the rank drivers import; a name that fails to import is skipped
# (it is imported again, or reported, in the command that needs it).
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "kforge_cli.cli.app",
    "kforge_cli.cli.train",
    "kforge_cli.cli.resume",
    "kforge_cli.cli.inspect_ckpt",
    "kforge_cli.cli.export_hf",
    "kforge_cli.cli.convert_mot",
    "kforge_cli.cli.validate",
    "kforge_cli.cli.prepare_data",
    "kforge_cli.engine.train",
    "kforge_cli.engine.checkpoint",
    "kforge_cli.engine.parallel",
    "kforge_cli.engine.data",
    "kforge_cli.engine.observe",
    "kforge_cli.engine.inference",
    "kforge_cli.engine.model",
)

# The path entries of this server's own start (its PYTHONPATH and `-m`'s working directory);
# each command gets a fresh interpreter's: its script's directory, its PYTHONPATH, then the rest.
_BASE_PATH: list[str] = []


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("client closed the connection mid-request")
        data += chunk
    return data


def serve(path: str) -> tuple[dict[str, Any], list[int]] | None:
    """Accept commands until stdin closes; returns (request, fds) in a forked command process."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # a CUDA check while preloading must not poison the forks
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # preloading is best effort
            print(f"preloaded: skipped {name}: {exc!r}", file=sys.stderr, flush=True)
    # kforge's own in-process cache of the built-in corpus (pure Python and numpy, ~0.5 s a process).
    try:
        from kforge_cli.engine.data.builtin_corpus import builtin_tokens

        builtin_tokens()
    except Exception as exc:  # best effort, as above
        print(f"preloaded: no built-in corpus: {exc!r}", file=sys.stderr, flush=True)
    # What is loaded now lives as long as any command: keep it out of the garbage collector's passes
    # (measured: the exit of a process that imported torch and kforge takes ~0.1 s instead of ~0.7 s).
    gc.collect()
    gc.freeze()
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    own.add(os.getcwd())
    _BASE_PATH[:] = [p for p in sys.path[1:] if os.path.abspath(p or ".") not in own]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: it appears ready to accept
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters reap their command; nobody reaps them
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            return None  # the test process is gone
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            header, fds, _, _ = socket.recv_fds(conn, 8, 3)
            header += _recv_exact(conn, 8 - len(header))  # recv_fds may return fewer bytes
            request = json.loads(_recv_exact(conn, int.from_bytes(header, "big")))
            if len(fds) != 3:
                raise ValueError(f"{len(fds)} file descriptors, not 3")
        except (ConnectionError, ValueError, OSError) as exc:
            print(f"preloaded: bad request: {exc!r}", file=sys.stderr, flush=True)
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:  # the waiter
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:  # the command
                conn.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"pid {pid}\n".encode())
                _, status = os.waitpid(pid, 0)
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _std_stream(fd: int, old: io.TextIOWrapper, env: dict[str, str]) -> io.TextIOWrapper:
    """What a fresh interpreter would open on ``fd`` under ``env`` (line buffering: a tty, or stderr)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    raw = io.FileIO(fd, "wb", closefd=False)
    buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer,
        encoding=old.encoding,
        errors=old.errors,
        line_buffering=os.isatty(fd) or fd == 2,
        write_through=unbuffered,
    )


def become(request: dict[str, Any], fds: list[int]) -> None:
    """Turn this forked process into the requested command's: stdio, directory, environment, path, argv."""
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    env: dict[str, str] = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "rb", closefd=False), encoding=sys.stdin.encoding)
    sys.stdout = sys.__stdout__ = _std_stream(1, sys.stdout, env)  # type: ignore[arg-type]
    sys.stderr = sys.__stderr__ = _std_stream(2, sys.stderr, env)  # type: ignore[arg-type]
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # A fresh process's __main__: the console script (kforge) or the module run with -m (call);
    # multiprocessing's spawn start method re-imports it in its workers.
    main = types.ModuleType("__main__")
    if request["kind"] == "kforge":
        script = os.path.join(os.path.dirname(sys.executable), "kforge")
        main.__file__ = script
        main.__spec__ = None
        first = os.path.dirname(script)
        sys.argv = [script, *request["args"]]
    else:
        module = request["target"].split(":")[0]
        main.__spec__ = importlib.util.find_spec(module)  # type: ignore[attr-defined]
        main.__file__ = main.__spec__.origin if main.__spec__ else None  # type: ignore[union-attr]
        first = os.getcwd()
        sys.argv = [main.__file__ or module, *map(str, request["args"])]
    sys.path[:] = [first, *python_path, *(p for p in _BASE_PATH if p not in python_path)]
    sys.modules["__main__"] = main


if __name__ == "__main__":
    import importlib.util

    served = serve(sys.argv[1])
    if served is None:
        sys.exit(0)
    request, fds = served
    become(request, fds)
    del served, fds
    if request["kind"] == "kforge":
        from kforge_cli.cli.app import main as kforge_main

        kforge_main()  # reads sys.argv and exits through SystemExit, as the console script does
    else:
        module_name, function = request["target"].split(":")
        getattr(importlib.import_module(module_name), function)(*request["args"])
