"""`kforge train --nproc-per-node N`: start N local training processes and own their signals.

The children get the environment torchrun would give them (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free local port) and run the same
command without the flag, detecting the launch like any torchrun job. This launcher is
deliberately not torch's elastic agent: on SIGINT/SIGTERM the agent raises
``SignalException`` (a long traceback, exit 1), SIGKILLs children that take longer than
30 s to save, and throws their exit codes away. Here a signal is forwarded once to every
child (they run in their own session, so a terminal's Ctrl-C reaches them only through
this forward), the launcher waits for them, and exits with their code: 75 when they
stopped after saving a checkpoint, 76 when the hang watchdog stopped them (hung ranks exit by
themselves). When one child fails the others are stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from kforge_cli.engine.runtime.threads import allowed_cpus, choose_threads
from kforge_cli.errors import EXIT_FAILURE, EXIT_HANG

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
STOP_GRACE_S = 60.0  # after a failed rank, how long the others get to exit before SIGKILL


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_env(nproc: int, rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        KFORGE_LOCAL_CHILD="1",  # cli.options.LOCAL_CHILD_ENV: the launcher printed the config warnings once
    )
    if rank != 0 and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # torch's C++ warnings (e.g. "No backend of type 0 found" at teardown) once, from rank 0, not N times;
        # the Python warnings of the other ranks go to their logs/rank_N.log (engine.observe.logs)
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


def oversubscription_warning(nproc: int, cores: int) -> str | None:
    """A warning when ``nproc`` processes will time-share fewer cores (None when they fit)."""
    if nproc <= cores:
        return None
    return (
        f"warning: --nproc-per-node {nproc} starts {nproc} training processes on {cores} "
        f"{'core' if cores == 1 else 'cores'}: they time-share the cores (each step waits for the slowest "
        f"process), so this runs slower than --nproc-per-node {cores}; fine for trying a distributed config, "
        "not for speed"
    )


def exit_code_of(returncodes: list[int]) -> int:
    """The job's code: 0 when all succeeded, else the first positive code (75 = saved, requeue),
    else 128 + the signal that killed a child (as a shell reports it)."""
    if all(code == 0 for code in returncodes):
        return 0
    positive = [code for code in returncodes if code > 0]
    if positive:
        return positive[0]
    return 128 + -min(returncodes)


def launch_local(nproc: int, child_args: list[str]) -> int:
    """Run ``python -m kforge_cli <child_args>`` in ``nproc`` processes; returns the job's exit code."""
    warning = oversubscription_warning(nproc, allowed_cpus())
    if warning:
        print(f"kforge: {warning}", file=sys.stderr)
    if not os.environ.get("OMP_NUM_THREADS"):
        choice = choose_threads(None, {**os.environ, "LOCAL_WORLD_SIZE": str(nproc)})
        os.environ["OMP_NUM_THREADS"] = str(choice.threads)
        print(f"kforge: {choice.describe()}", file=sys.stderr)
    port = _free_port()
    sys.stdout.flush()
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    children: list[subprocess.Popen[bytes]] = []
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        for rank in range(nproc):
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kforge_cli", *child_args],
                    env=_child_env(nproc, rank, port),
                    start_new_session=True,
                )
            )
        return _wait(children, received)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(children: list[subprocess.Popen[bytes]], received: list[int]) -> int:
    """Wait for every child; after the first failure (not a signal stop) stop the rest."""
    failed_at: float | None = None
    first_failure: int | None = None
    while any(child.poll() is None for child in children):
        codes = [child.returncode for child in children if child.returncode is not None]
        if failed_at is None and not received and any(code != 0 for code in codes):
            failed_at = time.monotonic()
            first_failure = next(code for code in codes if code != 0)
            for child in children:
                if child.poll() is None and first_failure != EXIT_HANG:  # hung peers exit by themselves
                    child.send_signal(signal.SIGTERM)
        if failed_at is not None and time.monotonic() - failed_at > STOP_GRACE_S:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.1)
    codes = [child.returncode for child in children]
    code = exit_code_of(codes if first_failure is None else [first_failure])
    if code == EXIT_HANG:
        print(
            f"kforge: a rank hung (exit code {EXIT_HANG}): RUN_DIR/logs/hang/summary.txt names it; "
            "the same command resumes from the last complete checkpoint",
            file=sys.stderr,
        )
    elif code not in (0, 75) and not received:
        failed = sum(1 for c in codes if c != 0)
        print(f"kforge: {failed} of {len(children)} processes failed (exit code {code})", file=sys.stderr)
    return code if code >= 0 else EXIT_FAILURE
