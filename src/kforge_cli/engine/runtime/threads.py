"""How many CPU threads each training process uses, chosen once per process.

torch's default is one intra-op thread per physical core. On a shared machine that is
the wrong number: when another job keeps one of two cores busy, two OpenMP threads
spend most of their time waiting for each other at barriers (a tenth of the speed of
one thread). So the default is the cores this process may run on (its CPU affinity
and the cgroup's CPU quota), minus the cores other work keeps busy right now (measured
over a short window from /proc/stat), divided by the training processes on this node.
An explicit ``train.num_threads`` wins, then ``OMP_NUM_THREADS``. Pure stdlib, so the
launcher can use it before any child starts.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
_PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class ThreadChoice:
    """The chosen thread count and why (the sentence logged once per run)."""

    threads: int
    source: str  # "train.num_threads", "OMP_NUM_THREADS" or "auto"
    reason: str

    def describe(self) -> str:
        return f"{_count(self.threads, 'CPU thread')} per process ({self.reason})"


def allowed_cpus() -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def _cpu_times() -> dict[str, tuple[int, int]]:
    """Per-CPU (busy, total) jiffies from /proc/stat (empty where it cannot be read)."""
    times: dict[str, tuple[int, int]] = {}
    try:
        lines = _PROC_STAT.read_text().splitlines()
    except OSError:
        return times
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        values = [int(v) for v in fields[:8]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        times[name] = (sum(values) - idle, sum(values))
    return times


def busy_cpus(window_s: float = 0.2) -> int:
    """Cores of this process's affinity set kept busy by other work over ``window_s`` seconds.

    This process sleeps during the window, so whatever is busy is someone else. A core
    counts when it is busy more than half the time (rounded sum over the cores).
    """
    try:
        mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        mine = None
    before = _cpu_times()
    if not before:
        return 0
    time.sleep(window_s)
    after = _cpu_times()
    load = 0.0
    for name, (busy1, total1) in after.items():
        if (mine is not None and name not in mine) or name not in before:
            continue
        busy0, total0 = before[name]
        if total1 > total0:
            load += (busy1 - busy0) / (total1 - total0)
    return int(load + 0.5)


def local_processes(env: Mapping[str, str]) -> int:
    """Training processes that share this process's cores (torchrun's LOCAL_WORLD_SIZE).

    srun binds each task to its own cores (``--cpus-per-task``), so its tasks do not share.
    """
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def choose_threads(
    num_threads: int | None,
    env: Mapping[str, str] | None = None,
    *,
    allowed: int | None = None,
    busy: int | None = None,
) -> ThreadChoice:
    """The thread count for this process: train.num_threads > OMP_NUM_THREADS > a fair share."""
    env = os.environ if env is None else env
    if num_threads:
        return ThreadChoice(num_threads, "train.num_threads", "train.num_threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS", f"OMP_NUM_THREADS={omp}")
    allowed = allowed_cpus() if allowed is None else allowed
    busy = busy_cpus() if busy is None else busy
    nproc = local_processes(env)
    free = max(1, allowed - min(busy, allowed - 1))
    threads = max(1, free // nproc)
    reason = (
        f"automatic: {_count(allowed, 'core')} available, {busy} busy with other work, "
        f"{_count(nproc, 'local process', 'local processes')}"
    )
    return ThreadChoice(threads, "auto", reason + "; set train.num_threads or OMP_NUM_THREADS to choose")


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"
