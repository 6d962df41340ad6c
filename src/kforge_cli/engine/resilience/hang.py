"""Hang watchdog: a thread on every rank that notices when the training loop stops moving.

The loop marks its phase (``mark``: data, forward/backward, update, log, eval, checkpoint,
...) and every finished step (``beat``); both are plain attribute writes. The watchdog
thread wakes a few times per limit and compares the time since the last mark with the
limit of the current phase:

- ``resilience.hang_timeout_s`` when set (> 0); else max(10 x the median step time, 300 s),
  capped at 0.8 x the process-group timeout, so the watchdog fires before a collective
  times out (an explicit limit raises the process-group timeout instead, see
  `engine.runtime.process_group_timeout_s`);
- the cap (0.8 x the process-group timeout) for slow phases (evaluation, checkpoint saves,
  a rewind) and until the first few steps have shown the step time.

When it fires, the rank writes ``RUN_DIR/logs/hang/rank_N.txt`` (what it was doing: phase,
step, the collective it is in or last entered, and every thread's Python stack),
``rank_N.json`` (the same facts for the summary) and, where torch's flight recorder holds
entries, ``rank_N.fr_trace.pkl`` (its pickle dump, for torch's ``fr_trace`` analyser).
Every rank of a hung job fires at about the same time (the waiting ranks make no progress
either), so they meet on the filesystem, not in a collective: each waits briefly for the
others' reports, rank 0 (or, if it cannot, the first rank to claim ``summary.lock``) writes
``summary.txt`` naming the rank(s) that stopped and where, and every rank exits with
`EXIT_HANG` (76): the generated sbatch requeues the job and the next start resumes from
the last complete checkpoint.

A stopped rank is told apart from a waiting one two ways: its main thread is not inside
``torch.distributed`` (a waiting rank is), and, from the flight recorder, it has not
entered the collective (sequence number) the others have. A hang that holds the GIL in C
code stops this thread too; the process-group timeout remains the backstop for that.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import pickle
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import TypedDict

from kforge_cli.errors import EXIT_HANG
from kforge_cli.json_values import int_of
from kforge_cli.rundir import names

log = logging.getLogger("kforge")

ARM_AFTER_STEPS = 3  # steps this process must finish before the step limit applies (compile, warm-up)
AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 300.0
CAP_FRACTION = 0.8  # of the process-group timeout
SLOW_PHASES = frozenset({"startup", "eval", "checkpoint", "rewind", "final"})
GATHER_S = 20.0  # how long a firing rank waits for the other ranks' reports
SUMMARY = names.HANG_SUMMARY_FILE
_DIST_MARK = f"{os.sep}torch{os.sep}distributed{os.sep}"


def hang_dir(run_dir: Path) -> Path:
    return run_dir / names.LOGS_DIR / names.HANG_DIR


def step_limit_s(timeout_s: float | None, median_step_s: float | None, cap_s: float) -> float:
    """The no-progress limit of a training step's phase (see the module docstring)."""
    if timeout_s:
        return float(timeout_s)
    if median_step_s is None:
        return cap_s
    return min(max(AUTO_FACTOR * median_step_s, AUTO_FLOOR_S), cap_s)


def _exit_process(code: int) -> None:
    """Flush every log handler and the standard streams, then end the process at once."""
    for logger in (logging.getLogger(), log):
        for handler in logger.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class NullWatchdog:
    """What the loop marks when the watchdog is off (``resilience.hang_timeout_s = 0``)."""

    fired = threading.Event()

    def mark(self, phase: str) -> None:
        pass

    def beat(self, step: int) -> None:
        pass

    def restart_timing(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def wait_if_fired(self) -> None:
        pass


class HangWatchdog:
    """The watchdog of one rank; `start` it before the loop and `stop` it after."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        directory: Path,
        timeout_s: float | None,
        pg_timeout_s: float,
        resume_note: Callable[[], str] = lambda: "",
        exit_fn: Callable[[int], None] = _exit_process,
        gather_s: float = GATHER_S,
    ) -> None:
        self.rank, self.world_size, self.directory = rank, world_size, directory
        self.timeout_s, self.cap_s = timeout_s, CAP_FRACTION * pg_timeout_s
        self.resume_note, self.exit_fn, self.gather_s = resume_note, exit_fn, gather_s
        self.step = 0
        self._where: tuple[str, float] = ("startup", time.monotonic())  # one attribute: read atomically
        self._steps_done = 0
        self._last_beat: float | None = None
        self._durations: deque[float] = deque(maxlen=64)
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- called by the training loop (cheap: attribute writes) --------------------------

    def mark(self, phase: str) -> None:
        """The loop entered ``phase`` (progress)."""
        self._where = (phase, time.monotonic())

    def beat(self, step: int) -> None:
        """Optimizer step ``step`` finished (progress; its duration feeds the automatic limit)."""
        now = time.monotonic()
        if self._last_beat is not None:
            self._durations.append(now - self._last_beat)
        self._last_beat = now
        self.step = step
        self._steps_done += 1
        self._where = ("step end", now)

    def restart_timing(self) -> None:
        """Forget the last beat (after a rewind or a long pause, so it does not count as a step)."""
        self._last_beat = None

    # ---- the thread ---------------------------------------------------------------------

    def limit_s(self, phase: str) -> float:
        if phase in SLOW_PHASES or self._steps_done < ARM_AFTER_STEPS:
            return max(self.cap_s, self.timeout_s or 0.0)
        median = statistics.median(self._durations) if self._durations else None
        return step_limit_s(self.timeout_s, median, self.cap_s)

    def start(self) -> HangWatchdog:
        self.mark("startup")
        self._thread = threading.Thread(target=self._run, name="kforge-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and not self.fired.is_set():
            self._thread.join(timeout=5)

    def wait_if_fired(self) -> None:
        """On the main thread's failure path: when the watchdog fired, let it finish (it exits the process)."""
        if self.fired.is_set() and self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            phase, since = self._where
            limit = self.limit_s(phase)
            if self._stop.wait(min(5.0, max(0.1, limit / 10))):
                return
            phase, since = self._where
            idle = time.monotonic() - since
            limit = self.limit_s(phase)
            if idle > limit:
                self.fired.set()
                try:
                    self._fire(phase, idle, limit)
                except Exception:  # the report is best effort; the exit is not
                    log.exception("hang watchdog: writing the report failed")
                finally:
                    self.exit_fn(EXIT_HANG)
                return

    # ---- firing -------------------------------------------------------------------------

    def _fire(self, phase: str, idle: float, limit: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        facts, text = self.report(phase, idle, limit)
        raw = flight_recorder_dump()
        if raw is not None:
            _atomic_write(self.directory / f"rank_{self.rank}.fr_trace.pkl", raw)
        _atomic_write(self.directory / f"rank_{self.rank}.txt", text.encode())
        _atomic_write(self.directory / f"rank_{self.rank}.json", json.dumps(facts, indent=1).encode())
        log.error(
            "hang watchdog: no progress for %.1f s in phase '%s' after step %d (limit %.1f s); stacks in %s; "
            "exiting with %d so the job is requeued%s",
            idle,
            phase,
            self.step,
            limit,
            self.directory / f"rank_{self.rank}.txt",
            EXIT_HANG,
            self.resume_note(),
        )
        self._summarise()

    def report(self, phase: str, idle: float, limit: float) -> tuple[RankReport, str]:
        """(facts for the summary, the text of rank_N.txt) of this rank now."""
        frames = sys._current_frames()
        main = threading.main_thread()
        main_frame = frames.get(main.ident or -1)
        where, in_collective, collective_frame = describe_frame(main_frame)
        fr = flight_recorder_entries()
        last = last_collectives(fr) if fr is not None else {}
        facts: RankReport = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "phase": phase,
            "idle_s": round(idle, 3),
            "limit_s": round(limit, 3),
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "where": where,
            "in_collective": in_collective,
            "collective_frame": collective_frame,
            "last_collectives": last,
            "flight_recorder": fr is not None,
        }
        lines = [
            f"kforge hang report: rank {self.rank} of {self.world_size} on {facts['host']} (pid {facts['pid']})",
            f"time: {facts['time']}",
            f"step: {self.step} optimizer steps finished",
            f"phase: {phase} (no progress for {idle:.1f} s, limit {limit:.1f} s)",
            f"main thread: {'inside a collective' if in_collective else 'NOT in a collective'} at {where}",
        ]
        if collective_frame:
            lines.append(f"collective frame: {collective_frame}")
        if last:
            lines.append("last collective entered, per process group (torch flight recorder):")
            lines += [f"  {pg}: #{c['seq']} {c['op']} ({c['state']})" for pg, c in sorted(last.items())]
        else:
            lines.append("last collective entered: no flight-recorder entries on this rank")
        lines += ["", "Python stacks (every thread):"]
        names = {t.ident: t for t in threading.enumerate()}
        for ident, frame in frames.items():
            t = names.get(ident)
            label = f"{t.name}{' (daemon)' if t.daemon else ''}" if t is not None else "unknown thread"
            lines.append(f"\nThread {label}, id {ident}{' [main]' if ident == main.ident else ''}:")
            lines += [s.rstrip("\n") for s in traceback.format_stack(frame)]
        return facts, "\n".join(lines) + "\n"

    def _summarise(self) -> None:
        """Wait for the other ranks' reports; rank 0 (or the first that can) writes the summary."""
        deadline = time.monotonic() + self.gather_s
        while time.monotonic() < deadline and len(list(self.directory.glob("rank_*.json"))) < self.world_size:
            time.sleep(0.2)
        summary = self.directory / SUMMARY
        if self.rank != 0:  # give rank 0 the first chance
            _wait_for(summary, 3.0)
        if not summary.exists() and _claim(self.directory / "summary.lock"):
            text = summarise(self.directory, self.world_size, note=self.resume_note())
            _atomic_write(summary, text.encode())
            log.error("hang summary (%s):\n%s", summary, text)
        _wait_for(summary, 5.0)


class CollectiveMark(TypedDict):
    """The last collective a rank entered in one process group (from the flight recorder)."""

    seq: int
    op: str
    state: str


class RankReport(TypedDict):
    """``rank_N.json``: one rank's facts when the watchdog fired (the summary reads every rank's)."""

    rank: int
    world_size: int
    host: str
    pid: int
    step: int
    phase: str
    idle_s: float
    limit_s: float
    time: str
    where: str
    in_collective: bool
    collective_frame: str | None
    last_collectives: dict[str, CollectiveMark]
    flight_recorder: bool


# ---- the stack and the flight recorder -----------------------------------------------------


def _frame_text(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def describe_frame(frame: FrameType | None) -> tuple[str, bool, str | None]:
    """(innermost frame, whether it is inside torch.distributed, the innermost torch.distributed frame)."""
    if frame is None:
        return "unknown", False, None
    inner = _frame_text(frame)
    collective = None
    f: FrameType | None = frame
    while f is not None:
        if _DIST_MARK in f.f_code.co_filename:
            collective = _frame_text(f)
            break
        f = f.f_back
    return inner, _DIST_MARK in frame.f_code.co_filename, collective


def flight_recorder_dump() -> bytes | None:
    """torch's flight-recorder pickle (collectives of every process group this process ran), or None."""
    try:
        import torch._C._distributed_c10d as c10d
    except Exception:
        return None
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            raw = dump()
        except Exception:
            continue
        return raw if isinstance(raw, bytes) else None
    return None


def flight_recorder_entries() -> list[dict[str, object]] | None:
    """The flight recorder's entries (our own process's dump), or None when it has none."""
    raw = flight_recorder_dump()
    if raw is None:
        return None
    try:
        entries = pickle.loads(raw).get("entries") or []  # this process's own dump, never a file
    except Exception:
        return None
    return entries or None


def last_collectives(entries: list[dict[str, object]]) -> dict[str, CollectiveMark]:
    """Per process group: the last collective entered (sequence number, op, state)."""
    out: dict[str, CollectiveMark] = {}
    for e in entries:
        pg = e.get("process_group") or ("?", "?")
        key = f"pg {pg[0]} ({pg[1]})" if isinstance(pg, list | tuple) and len(pg) == 2 else str(pg)
        p2p = bool(e.get("is_p2p"))
        seq = int_of(e.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        if p2p:
            key += " p2p"
        if key not in out or seq >= out[key]["seq"]:
            out[key] = {"seq": seq, "op": str(e.get("profiling_name", "?")), "state": str(e.get("state", "?"))}
    return out


# ---- the summary ----------------------------------------------------------------------------


def _read_reports(directory: Path, world_size: int) -> dict[int, dict[str, object]]:
    """The rank reports that parse as JSON objects (read back from disk: each field is checked where used)."""
    reports: dict[int, dict[str, object]] = {}
    for r in range(world_size):
        path = directory / f"rank_{r}.json"
        with contextlib.suppress(OSError, ValueError):
            report: object = json.loads(path.read_text())
            if isinstance(report, dict):
                reports[r] = report
    return reports


def _collectives(report: Mapping[str, object]) -> dict[str, CollectiveMark]:
    """A report's ``last_collectives``; an entry without an integer ``seq`` is left out."""
    found = report.get("last_collectives")
    out: dict[str, CollectiveMark] = {}
    if isinstance(found, dict):
        for pg, c in found.items():
            if isinstance(c, dict) and isinstance(seq := c.get("seq"), int):
                out[str(pg)] = {"seq": seq, "op": str(c.get("op", "?")), "state": str(c.get("state", "?"))}
    return out


def _short(where: str) -> str:
    """A frame with its path cut to the package part (kforge_cli/..., torch/..., tests/...)."""
    for mark in ("kforge_cli", "torch", "tests"):
        i = where.find(f"{os.sep}{mark}{os.sep}")
        if i >= 0:
            return where[i + 1 :]
    return where


def stopped_ranks(reports: Mapping[int, Mapping[str, object]], world_size: int) -> tuple[list[int], dict[int, str]]:
    """(the ranks that stopped, why each) from the reports: no report at all; or not inside a
    collective while behind the others' sequence number in some process group; else either."""
    why: dict[int, str] = {}
    missing = [r for r in range(world_size) if r not in reports]
    for r in missing:
        why[r] = "wrote no report (exited, killed, or stuck holding the GIL)"
    behind: dict[int, str] = {}
    groups: dict[str, dict[int, CollectiveMark]] = {}
    for r, rep in reports.items():
        for pg, c in _collectives(rep).items():
            groups.setdefault(pg, {})[r] = c
    for pg, per_rank in groups.items():
        if len(per_rank) < 2:
            continue
        top = max(c["seq"] for c in per_rank.values())
        ahead = next(c for c in per_rank.values() if c["seq"] == top)
        for r, c in per_rank.items():
            if c["seq"] < top and r not in behind:
                behind[r] = f"did not enter {ahead['op']} #{top} of {pg} (its last: #{c['seq']})"
    idle = {r for r, rep in reports.items() if not rep.get("in_collective")}
    chosen = set(behind) & idle or set(behind) or (idle if len(idle) < len(reports) else set())
    for r in chosen:
        parts = []
        if r in idle:
            parts.append(
                f"not in a collective: {reports[r].get('phase')} at {_short(str(reports[r].get('where', '?')))}"
            )
        if r in behind:
            parts.append(behind[r])
        why[r] = "; ".join(parts)
    return sorted(set(missing) | chosen), why


def summarise(directory: Path, world_size: int, note: str = "") -> str:
    """The one-screen summary of the rank reports in ``directory``."""
    reports = _read_reports(directory, world_size)
    stopped, why = stopped_ranks(reports, world_size)
    steps = sorted({step if isinstance(step := rep.get("step", -1), int) else -1 for rep in reports.values()})
    idle = max(
        (s if isinstance(s := rep.get("idle_s", 0.0), int | float) else 0.0 for rep in reports.values()), default=0.0
    )
    lines = [
        f"kforge hang: no progress for {idle:.0f} s at step {'/'.join(map(str, steps)) or '?'}; "
        f"{len(reports)} of {world_size} ranks reported.",
        "",
    ]
    if stopped:
        for r in stopped:
            host = reports.get(r, {}).get("host", "?")
            lines.append(f"Stopped: rank {r} (host {host}): {why[r]}")
    else:
        lines.append(
            "Stopped: no single rank stands out (every reporting rank is at the same collective position): "
            "a stuck communicator or network, or ranks in different collectives; see the flight-recorder dumps."
        )
    waiting = [r for r, rep in sorted(reports.items()) if rep.get("in_collective") and r not in stopped]
    if waiting:
        shown = ", ".join(map(str, waiting[:16])) + (f" and {len(waiting) - 16} more" if len(waiting) > 16 else "")
        lines.append(f"Waiting in a collective: rank(s) {shown}")
    lines += ["", f"{'rank':>4}  {'host':<16} {'step':>6}  {'phase':<17} {'last collective':<36} where"]
    rows = [r for r in sorted(reports) if r in stopped] + [r for r in sorted(reports) if r not in stopped]
    for r in rows[:12]:
        rep = reports[r]
        last = _collectives(rep)
        newest = max(last.values(), key=lambda c: c["seq"], default=None) if last else None
        coll = f"{newest['op']} #{newest['seq']}" if newest else "-"
        where = _short(str(rep.get("collective_frame") or rep.get("where") or "?"))
        lines.append(
            f"{r:>4}  {str(rep.get('host', '?'))[:16]:<16} {rep.get('step', '?'):>6}  "
            f"{str(rep.get('phase', '?'))[:17]:<17} {coll[:36]:<36} {where}"
        )
    if len(rows) > 12:
        lines.append(f"      ... {len(rows) - 12} more rank(s): see the rank_N.txt files")
    lines += [
        "",
        f"Every thread's stack: {directory}/rank_N.txt; torch flight recorder: rank_N.fr_trace.pkl "
        "(python -m torch.distributed.flight_recorder.fr_trace DIR --prefix rank_ where torch ships it).",
        f"Exit code {EXIT_HANG}: the generated sbatch requeues the job; the next start resumes from the last "
        f"complete checkpoint{note}.",
    ]
    return "\n".join(lines) + "\n"


def archive_previous(directory: Path) -> Path | None:
    """Move an earlier attempt's hang reports to ``hang.N`` (first free N); returns where, or None."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    n = 1
    while directory.with_name(f"{directory.name}.{n}").exists():
        n += 1
    dest = directory.with_name(f"{directory.name}.{n}")
    directory.rename(dest)
    return dest


# ---- files ----------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
