"""How the tests start processes: `kforge` commands, the ranks of a distributed job, torchrun.

``start_kforge`` / ``run_kforge`` run one ``kforge`` command; ``kforge_ranks`` runs
``kforge train`` as the ranks of one job (RANK, WORLD_SIZE, ... set as torchrun sets
them); ``run_ranks`` runs many cases in one multi-rank launch of ``tests.helpers.ranks``
(one process group, one result file per case and rank).

Each of these processes is forked from a *preloaded* server (``tests.helpers.preloaded``)
that imported torch and kforge once: starting Python and importing them costs ~3 s of CPU,
about 90% of a tiny ``kforge train``. The forked process is still a process of its own
(exit code, signals, environment, working directory, stdio, interpreter exit). Rank ``r``
comes from server ``r % 2``, each server with its own hash seed, so the ranks of one job
do not share one (as fresh interpreters would not). ``KFORGE_TEST_FRESH_PROCESSES=1``
starts fresh interpreters instead (the console script, and torchrun for ``run_ranks``), and
so does a machine with a GPU: a CUDA context does not survive a fork, and GPU machines have
the cores to spare.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]


def fresh_processes() -> bool:
    """Whether commands start as fresh interpreters (asked for, or a GPU present) instead of forks."""
    global _FRESH
    if _FRESH is None:
        _FRESH = os.environ.get("KFORGE_TEST_FRESH_PROCESSES") == "1"
        if not _FRESH:
            import torch

            _FRESH = torch.cuda.device_count() > 0  # NVML first: does not initialise CUDA here
    return _FRESH


_FRESH: bool | None = None
# Stable across runs, so a torch.compile after the first is a cache hit.
INDUCTOR_CACHE = Path(tempfile.gettempdir()) / "kforge-test-inductor-cache"
PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
Stream = None | int | IO[Any]


def kforge_cmd() -> list[str]:
    """The installed `kforge` console script (falls back to `python -m kforge_cli`): a fresh interpreter."""
    exe = shutil.which("kforge", path=str(Path(sys.executable).parent)) or shutil.which("kforge")
    return [exe] if exe else [sys.executable, "-m", "kforge_cli"]


def with_repo_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the repository first on PYTHONPATH (what hooks given by import path need)."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])}


class _Server:
    """One preloaded server process and the socket it accepts commands on."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kforge-preloaded-"))
        self.socket = self.dir / "s"
        env = {**os.environ, "PYTHONHASHSEED": str(random.randrange(1, 2**32))}
        with (self.dir / "server.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.preloaded", str(self.socket)],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the preloaded server did not start:\n{self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        path = self.dir / "server.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()  # the server exits on EOF
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVERS: dict[int, _Server] = {}


def _server(slot: int) -> _Server:
    server = _SERVERS.get(slot)
    if server is None or not server.alive():
        server = _SERVERS[slot] = _Server()
    return server


@atexit.register
def _stop_servers() -> None:
    for server in _SERVERS.values():
        server.stop()
    _SERVERS.clear()


class Proc:
    """The part of ``subprocess.Popen`` the tests use, for a command forked by a preloaded server."""

    def __init__(self, args: list[str], conn: socket.socket, stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        self.args = args
        self.returncode: int | None = None
        self.stdout, self.stderr = stdout, stderr
        self._conn, self._buf = conn, b""
        line = self._line(60)
        if line is None or not line.startswith("pid "):
            raise RuntimeError(f"the preloaded server started no process for {args}: {line!r}")
        self.pid = int(line.split()[1])

    def _line(self, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the preloaded waiter of {self.args} went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _exited(self, line: str) -> int:
        self.returncode = int(line.split()[1])
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self._exited(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._exited(line)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (the PIPE ones) to their end, then wait; as ``Popen.communicate``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[int, list[Any]] = {}
        with selectors.DefaultSelector() as sel:
            for stream in (self.stdout, self.stderr):
                if stream is not None:
                    sel.register(stream, selectors.EVENT_READ)
                    chunks[stream.fileno()] = []
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in sel.select(left):
                    stream = key.fileobj
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(stream)
                        continue
                    chunks[key.fd].append(data)
        out = [self._decode(s, chunks) for s in (self.stdout, self.stderr)]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out[0], out[1]

    @staticmethod
    def _decode(stream: IO[Any] | None, chunks: dict[int, list[Any]]) -> Any:
        if stream is None:
            return None
        data = b"".join(chunks[stream.fileno()])
        stream.close()
        return data.decode("utf-8", errors="replace") if "b" not in getattr(stream, "mode", "rb") else data


def _fd(stream: Stream, default: int, opened: list[int], stdout_fd: int | None = None) -> tuple[int, int | None]:
    """The descriptor a command gets for ``stream`` and, for PIPE, the read end we keep."""
    if stream is None:
        return default, None
    if stream == STDOUT:
        assert stdout_fd is not None
        return stdout_fd, None
    if stream == DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd, None
    if stream == PIPE:
        read, write = os.pipe()
        opened.append(write)
        return write, read
    if isinstance(stream, int):
        return stream, None
    return stream.fileno(), None


def start_kforge(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: Stream = None,
    stderr: Stream = None,
    text: bool = True,
    slot: int = 0,
) -> Proc | subprocess.Popen[Any]:
    """``kforge ARGS`` as a process of its own (``Popen`` semantics: ``env`` replaces the environment)."""
    return _start("kforge", list(args), None, env, cwd, stdout, stderr, text, slot)


def start_python(
    target: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: Stream = None,
    stderr: Stream = None,
    slot: int = 0,
) -> Proc | subprocess.Popen[Any]:
    """``module:function(*args)`` in a process of its own (the function ends it, or the interpreter exits)."""
    return _start("call", list(args), target, env, cwd, stdout, stderr, True, slot)


def _start(
    kind: str,
    args: list[str],
    target: str | None,
    env: Mapping[str, str] | None,
    cwd: str | Path | None,
    stdout: Stream,
    stderr: Stream,
    text: bool,
    slot: int,
) -> Proc | subprocess.Popen[Any]:
    env = dict(os.environ if env is None else env)
    cwd = str(cwd if cwd is not None else os.getcwd())
    if fresh_processes():
        if kind == "kforge":
            cmd = [*kforge_cmd(), *args]
        else:
            module, function = (target or "").split(":")
            cmd = [sys.executable, "-c", f"import sys, {module} as m; m.{function}(*sys.argv[1:])", *args]
        return subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=text
        )
    opened: list[int] = []
    try:
        stdin_fd, _ = _fd(DEVNULL, 0, opened)
        out_fd, out_read = _fd(stdout, 1, opened)
        err_fd, err_read = _fd(stderr, 2, opened, stdout_fd=out_fd)
        request = json.dumps({"kind": kind, "args": args, "target": target, "env": env, "cwd": cwd}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(_server(slot).socket))
        socket.send_fds(conn, [len(request).to_bytes(8, "big")], [stdin_fd, out_fd, err_fd])
        conn.sendall(request)
    finally:
        for fd in opened:
            os.close(fd)  # the command holds its own copies
    mode = "r" if text else "rb"
    streams = [
        None if fd is None else (open(fd, mode, encoding="utf-8") if text else open(fd, mode))  # noqa: SIM115
        for fd in (out_read, err_read)
    ]
    return Proc([kind, *args], conn, streams[0], streams[1])


def run_kforge(
    *args: str, cwd: Path | None = None, env: Mapping[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``kforge ARGS`` to its end, stdout and stderr captured; ``env`` adds to this process's environment."""
    proc = start_kforge(args, env={**os.environ, **(env or {})}, cwd=cwd, stdout=PIPE, stderr=PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(list(args), proc.returncode or 0, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for a rank of a one-node job (and one intra-op thread)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def wait_all(procs: Sequence[Proc | subprocess.Popen[Any]], timeout: float, grace: float = 120) -> list[int]:
    """Every process's exit code; once one fails, the others get ``grace`` seconds (they may wait on it)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any((p.poll() or 0) != 0 for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    return [p.wait() for p in procs]


def kforge_ranks(
    world: int, run_dir: Path, args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 600
) -> list[tuple[int, str]]:
    """``kforge train --run-dir RUN_DIR ARGS`` as ``world`` ranks of one job; (exit code, output) per rank.

    Rank r's output goes to ``RUN_DIR.rank<r>.log`` next to the run directory."""
    port, procs, logs = free_port(), [], []
    run_dir.mkdir(parents=True, exist_ok=True)
    base = with_repo_path({**os.environ, **(env or {})})
    for rank in range(world):
        log = run_dir.parent / f"{run_dir.name}.rank{rank}.log"
        with log.open("wb") as f:
            cmd = ["train", "--run-dir", str(run_dir), *args]
            procs.append(
                start_kforge(cmd, env={**base, **rank_env(rank, world, port)}, stdout=f, stderr=STDOUT, slot=rank % 2)
            )
        logs.append(log)
    codes = wait_all(procs, timeout)
    return [(c, log.read_text()) for c, log in zip(codes, logs, strict=True)]


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command of a real one-node ``torch.distributed.run`` launch of ``args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def run_ranks(
    world: int, cases: Sequence[Mapping[str, Any]], out_dir: Path, timeout: float = 600
) -> dict[str, list[dict]]:
    """Run ``cases`` (each ``{"name", "fn": "module:function", "args"}``) in one ``world``-rank launch of
    ``tests.helpers.ranks``; {case name: [its result on rank r]}. A case that failed on some rank
    fails here with that rank's error; the cases after it did not run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "cases.json"
    spec.write_text(json.dumps(list(cases)))
    env = with_repo_path({**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE), "OMP_NUM_THREADS": "1"})
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    if fresh_processes():
        with logs[0].open("wb") as f:
            cmd = torchrun(world, "-m", "tests.helpers.ranks", str(spec), str(out_dir))
            codes = [subprocess.run(cmd, env=env, stdout=f, stderr=STDOUT, timeout=timeout).returncode]
    else:
        port, procs = free_port(), []
        for rank, log in enumerate(logs):
            with log.open("wb") as f:
                rank_run = {**env, **rank_env(rank, world, port)}
                procs.append(
                    start_python(
                        "tests.helpers.ranks:main",
                        [str(spec), str(out_dir)],
                        env=rank_run,
                        stdout=f,
                        stderr=STDOUT,
                        slot=rank % 2,
                    )
                )
        codes = wait_all(procs, timeout)
    results: dict[str, list[dict]] = {}
    for case in cases:
        name = case["name"]
        files = [out_dir / f"{name}.rank{r}.json" for r in range(world)]
        if not all(f.is_file() for f in files):
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"case {name} left no result on every rank (exit codes {codes}):\n{tails}")
        results[name] = [json.loads(f.read_text()) for f in files]
    return results
