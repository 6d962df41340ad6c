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
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path

from kforge_cli.engine.resilience.hang_report import (
    RankReport,
    claim_file,
    describe_frame,
    flight_recorder_dump,
    flight_recorder_entries,
    last_collectives,
    report_dir,
    stopped_record,
    summarise,
    wait_for_file,
    write_atomically,
)
from kforge_cli.errors import EXIT_HANG, KforgeError
from kforge_cli.rundir import names

log = logging.getLogger("kforge")

ARM_AFTER_STEPS = 3  # steps this process must finish before the step limit applies (compile, warm-up)
AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 300.0
CAP_FRACTION = 0.8  # of the process-group timeout
SLOW_PHASES = frozenset({"startup", "eval", "checkpoint", "rewind", "final"})
GATHER_S = 20.0  # how long a firing rank waits for the other ranks' reports
SUMMARY = names.HANG_SUMMARY_FILE
STOPPED = "stopped.json"  # the stopped ranks and their SLURM nodes, for the job script's exclusion decision


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
                except KforgeError as exc:  # e.g. logs/hang is a planted link: say why, write nothing
                    log.error("hang watchdog: no report written: %s", exc)
                except Exception:  # the report is best effort; the exit is not
                    log.exception("hang watchdog: writing the report failed")
                finally:
                    self.exit_fn(EXIT_HANG)
                return

    # ---- firing -------------------------------------------------------------------------

    def _fire(self, phase: str, idle: float, limit: float) -> None:
        report_dir(self.directory)
        facts, text = self.report(phase, idle, limit)
        raw = flight_recorder_dump()
        if raw is not None:
            write_atomically(self.directory / f"rank_{self.rank}.fr_trace.pkl", raw)
        write_atomically(self.directory / f"rank_{self.rank}.txt", text.encode())
        write_atomically(self.directory / f"rank_{self.rank}.json", json.dumps(facts, indent=1).encode())
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
            "node": os.environ.get("SLURMD_NODENAME"),
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
            f"kforge hang report: rank {self.rank} of {self.world_size} on {facts['host']}"
            + (f" (SLURM node {facts['node']})" if facts["node"] else "")
            + f" (pid {facts['pid']})",
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
            wait_for_file(summary, 3.0)
        if not summary.exists() and claim_file(self.directory / "summary.lock"):
            text = summarise(self.directory, self.world_size, note=self.resume_note())
            stopped = json.dumps(stopped_record(self.directory, self.world_size), indent=1) + "\n"
            write_atomically(self.directory / STOPPED, stopped.encode())  # first: the summary's presence ends the wait
            write_atomically(summary, text.encode())
            log.error("hang summary (%s):\n%s", summary, text)
        wait_for_file(summary, 5.0)
