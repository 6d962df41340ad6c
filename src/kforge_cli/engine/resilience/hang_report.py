"""The hang watchdog's reports: what each rank writes when it fires, and the summary that names the
rank(s) that stopped (see ``engine.resilience.hang`` for when it fires).

A stopped rank is told apart from a waiting one two ways: its main thread is not inside
``torch.distributed`` (a waiting rank is), and, from the flight recorder, it has not entered
the collective (sequence number) the others have.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TypedDict

from kforge_cli.common.files import atomic_write, read_text_capped, real_dir
from kforge_cli.common.json_values import int_of
from kforge_cli.errors import EXIT_HANG, KforgeError

_DIST_MARK = f"{os.sep}torch{os.sep}distributed{os.sep}"


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
    node: str | None  # SLURM's node name (SLURMD_NODENAME), None outside SLURM
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


MAX_REPORT_BYTES = 1 << 20  # a rank report is a few KB


def read_own_file(path: Path, max_bytes: int = MAX_REPORT_BYTES) -> str:
    """A file the watchdog wrote itself: a regular file, never through a link, capped (KforgeError/OSError if not)."""
    return read_text_capped(path, max_bytes, "hang report", follow_links=False)


def _read_reports(directory: Path, world_size: int) -> dict[int, dict[str, object]]:
    """The rank reports that parse as JSON objects (read back from disk: each field is checked where used;
    a link, FIFO or oversized file at a report's name is skipped, never read)."""
    reports: dict[int, dict[str, object]] = {}
    for r in range(world_size):
        path = directory / f"rank_{r}.json"
        with contextlib.suppress(OSError, ValueError, KforgeError):
            report: object = json.loads(read_own_file(path))
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
            node = reports.get(r, {}).get("node")
            at = f"host {host}, SLURM node {node}" if isinstance(node, str) and node else f"host {host}"
            lines.append(f"Stopped: rank {r} ({at}): {why[r]}")
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


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compact node list (``gpu[01-03,07],login1``) as names; [] for what it cannot read."""
    names: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", text.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                return []
            names += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return names


def slurm_rank_nodes(env: Mapping[str, str]) -> list[str]:
    """Each rank's SLURM node under srun's default block layout (``SLURM_STEP_NODELIST`` and
    ``SLURM_STEP_TASKS_PER_NODE``, e.g. ``2(x3)``); [] outside SLURM or when unreadable."""
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
    counts: list[int] = []
    for part in (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not nodes or len(counts) != len(nodes):
        return []
    return [node for node, n in zip(nodes, counts, strict=True) for _ in range(n)]


def stopped_record(directory: Path, world_size: int, env: Mapping[str, str] | None = None) -> dict[str, object]:
    """``stopped.json``: the stopped ranks with their host and SLURM node, the step and time; the job
    script's exclusion decision reads it (``kforge_cli.slurm.exclude``). A rank that wrote no report
    gets its node from the SLURM layout (``node_from``: "layout"), else None."""
    reports = _read_reports(directory, world_size)
    stopped, why = stopped_ranks(reports, world_size)
    steps = [s for rep in reports.values() if isinstance(s := rep.get("step"), int)]
    layout = slurm_rank_nodes(os.environ if env is None else env)
    ranks: list[dict[str, object]] = []
    for r in stopped:
        rep = reports.get(r, {})
        host, node = rep.get("host"), rep.get("node")
        entry: dict[str, object] = {
            "rank": r,
            "host": host if isinstance(host, str) else None,
            "node": node if isinstance(node, str) and node else None,
            "why": why[r],
        }
        if entry["node"] is None and len(layout) == world_size:
            entry["node"], entry["node_from"] = layout[r], "layout"
        ranks.append(entry)
    return {
        "step": max(steps, default=None),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": world_size,
        "ranks": ranks,
    }


def archive_previous(directory: Path) -> Path | None:
    """Move an earlier attempt's hang reports to ``hang.N`` (first free N); returns where, or None.

    A link at ``logs/hang`` is left where it is (never followed, never moved): the watchdog refuses
    to write through it when it fires.
    """
    if directory.is_symlink() or not directory.is_dir() or not any(directory.iterdir()):
        return None
    n = 1
    while directory.with_name(f"{directory.name}.{n}").exists():
        n += 1
    dest = directory.with_name(f"{directory.name}.{n}")
    directory.rename(dest)
    return dest


# ---- files ----------------------------------------------------------------------------------


def report_dir(directory: Path) -> Path:
    """``RUN_DIR/logs/hang`` made (with ``logs``) as real directories: a link at either is refused
    (SymlinkRefusedError), so no report or summary is ever written outside the run directory."""
    real_dir(directory.parent)
    return real_dir(directory)


def write_atomically(path: Path, data: bytes) -> None:
    """A report file written all-or-nothing through an unpredictable, exclusively created temporary
    name (``files.atomic_write``): a link planted in the directory is never written through."""
    atomic_write(path, data)


def claim_file(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def wait_for_file(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
