"""Which nodes a requeued job leaves behind: the decision the generated sbatch script asks for.

When the hang watchdog stops a job (exit 76) it writes ``RUN_DIR/logs/hang/stopped.json``
naming the rank(s) that stopped and their SLURM node (``SLURMD_NODENAME``); with
``resilience.exclude_stragglers`` the straggler report appends a record to
``RUN_DIR/logs/stragglers.jsonl`` and stops the run with a checkpoint (exit 75). Before it
requeues, the job script runs ``python -m kforge_cli.slurm.exclude RUN_DIR --from hang|straggler
--max N --need-nodes M [--partition-nodes P]``, which

- names the node to leave behind: the one node every stopped rank ran on (ranks stopped on
  several nodes point at the network or a communicator, not at a node: nothing is excluded),
  or the straggler record's node;
- adds it to ``RUN_DIR/excluded_nodes.json`` (written atomically, never through a link), which
  accumulates across requeues, with a cap: at most ``--max`` nodes (``slurm.max_excluded_nodes``)
  and never so many that the job no longer fits the partition (``P - M`` when the script knows
  the partition's size); past the cap the oldest exclusion is let go, so a node that was bad long
  ago gets another chance before the job runs out of nodes;
- prints the job's exclusion list (comma-separated SLURM node names, an empty line when none),
  which the script applies with ``scontrol update JobId=$SLURM_JOB_ID ExcNodeList=...``.

An event is applied once (its key is kept in the file's history), so running the decision twice
for the same hang or straggler record changes nothing. Torch-free and quick: it runs in the
batch shell between two training attempts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.common.files import atomic_write, read_text_capped, real_dir
from kforge_cli.errors import KforgeError

EXCLUDED_FILE = "excluded_nodes.json"
HANG_STOPPED = Path("logs") / "hang" / "stopped.json"
STRAGGLER_RECORDS = Path("logs") / "stragglers.jsonl"
MAX_FILE_BYTES = 1 << 20
# SLURM node names as they can go into ExcNodeList: no comma, space, brackets or shell specials.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


@dataclass(frozen=True)
class Suspect:
    """A node named by a hang or straggler report; ``key`` identifies the event (applied once)."""

    node: str
    reason: str  # "hang" or "straggler"
    key: str
    detail: str


def valid_node(name: object) -> bool:
    return isinstance(name, str) and bool(_NODE_NAME.match(name))


def _read_json(path: Path) -> object | None:
    """A file kforge wrote in the run directory, parsed; None when missing or unreadable (a link is never read)."""
    try:
        return json.loads(read_text_capped(path, MAX_FILE_BYTES, "exclusion input", follow_links=False))
    except (OSError, ValueError, KforgeError):
        return None


def hang_suspect(run_dir: Path) -> tuple[Suspect | None, str]:
    """(the node to exclude after a hang, why or why not) from ``logs/hang/stopped.json``."""
    found = _read_json(run_dir / HANG_STOPPED)
    if not isinstance(found, dict):
        return None, f"no readable {HANG_STOPPED}"
    ranks = [r for r in found.get("ranks") or [] if isinstance(r, dict)]
    if not ranks:
        return None, "the hang summary names no stopped rank"
    nodes = sorted({str(n) if valid_node(n) else "an unknown node" for n in (r.get("node") for r in ranks)})
    if len(nodes) != 1 or nodes[0] == "an unknown node":
        return None, f"the stopped rank(s) ran on {', '.join(nodes)}: no single SLURM node to leave behind"
    node = nodes[0]
    step = found.get("step", "?")
    named = ", ".join(f"rank {r.get('rank', '?')} (host {r.get('host', '?')})" for r in ranks[:8])
    return Suspect(node, "hang", f"hang:{step}:{found.get('time', '?')}:{node}", f"{named} stopped at step {step}"), ""


def straggler_suspect(run_dir: Path) -> tuple[Suspect | None, str]:
    """(the node of the last straggler record, why not) from ``logs/stragglers.jsonl``."""
    path = run_dir / STRAGGLER_RECORDS
    try:
        lines = read_text_capped(path, MAX_FILE_BYTES, "straggler records", follow_links=False).splitlines()
    except FileNotFoundError:
        return None, ""  # no straggler was ever recorded: nothing to say
    except (OSError, KforgeError):
        return None, f"no readable {STRAGGLER_RECORDS}"
    record: object = None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            break
    if not isinstance(record, dict):
        return None, f"no straggler record in {STRAGGLER_RECORDS}"
    node = record.get("node")
    if not valid_node(node):
        return None, f"the last straggler record names no SLURM node ({node!r})"
    assert isinstance(node, str)
    step = record.get("step", "?")
    detail = (
        f"rank {record.get('rank', '?')} (host {record.get('host', '?')}) {record.get('ratio', '?')}x the median "
        f"for {record.get('windows', '?')} logging intervals up to step {step}"
    )
    return Suspect(node, "straggler", f"straggler:{step}:{record.get('time', '?')}:{node}", detail), ""


def allowed_count(cap: int, need_nodes: int | None, partition_nodes: int | None) -> int:
    """How many nodes the job may leave behind: ``cap``, and fewer when the partition would be too small."""
    allowed = max(cap, 0)
    if partition_nodes is not None and need_nodes is not None and partition_nodes > 0:
        allowed = min(allowed, max(partition_nodes - need_nodes, 0))
    return allowed


def load(run_dir: Path) -> dict[str, list[dict[str, object]] | list[str]]:
    """``excluded_nodes.json`` as {"nodes": [...], "history": [...]} (empty when missing or unreadable)."""
    found = _read_json(run_dir / EXCLUDED_FILE)
    nodes: list[str] = []
    history: list[dict[str, object]] = []
    if isinstance(found, dict):
        nodes = [n for n in found.get("nodes") or [] if valid_node(n)]
        history = [h for h in found.get("history") or [] if isinstance(h, dict)]
    return {"nodes": list(dict.fromkeys(nodes)), "history": history}


def excluded_nodes(run_dir: Path, cap: int) -> list[str]:
    """The run's current exclusions (the newest ``cap`` of them), for a new job's ``#SBATCH --exclude``."""
    nodes = [str(n) for n in load(run_dir)["nodes"]]
    return nodes[len(nodes) - cap :] if cap > 0 else []


def decide(
    run_dir: Path, source: str, *, cap: int, need_nodes: int | None = None, partition_nodes: int | None = None
) -> tuple[list[str], list[str]]:
    """Apply the event of ``source`` ("hang", "straggler" or "none") to the run's exclusions.

    Returns (the exclusion list to apply, oldest first; lines saying what was decided) and
    rewrites ``excluded_nodes.json`` when anything changed.
    """
    state = load(run_dir)
    nodes = [str(n) for n in state["nodes"]]
    history = [h for h in state["history"] if isinstance(h, dict)]
    notes: list[str] = []
    suspect: Suspect | None = None
    if source == "hang":
        suspect, why = hang_suspect(run_dir)
    elif source == "straggler":
        suspect, why = straggler_suspect(run_dir)
    else:
        why = ""
    if suspect is None and why:
        notes.append(f"no node to exclude: {why}")
    allowed = allowed_count(cap, need_nodes, partition_nodes)
    changed = False
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    job = {
        k: os.environ[v] for k, v in (("job", "SLURM_JOB_ID"), ("restart", "SLURM_RESTART_COUNT")) if v in os.environ
    }
    if suspect is not None:
        if any(h.get("key") == suspect.key for h in history):
            notes.append(f"{suspect.node}: this {suspect.reason} was already handled")
        elif allowed == 0:
            notes.append(
                f"not excluding {suspect.node} ({suspect.reason}: {suspect.detail}): the cap allows no excluded node"
            )
        else:
            if suspect.node in nodes:
                nodes.remove(suspect.node)  # newest evidence: it moves to the end (let go last)
                notes.append(f"{suspect.node} is excluded again ({suspect.reason}: {suspect.detail})")
            else:
                notes.append(f"excluding {suspect.node} ({suspect.reason}: {suspect.detail})")
            nodes.append(suspect.node)
            history.append(
                {"time": now, "action": "exclude", "node": suspect.node, "reason": suspect.reason,
                 "detail": suspect.detail, "key": suspect.key, **job}
            )  # fmt: skip
            changed = True
    while len(nodes) > allowed:
        dropped = nodes.pop(0)
        limit = f"{allowed} (slurm.max_excluded_nodes = {cap}"
        if partition_nodes is not None and need_nodes is not None:
            limit += f"; the partition has {partition_nodes} nodes, the job needs {need_nodes}"
        notes.append(f"letting {dropped} back in: at most {limit}) nodes are excluded")
        history.append({"time": now, "action": "release", "node": dropped, "reason": "cap", **job})
        changed = True
    if changed:
        real_dir(run_dir)
        data = {"nodes": nodes, "history": history[-200:]}
        atomic_write(run_dir / EXCLUDED_FILE, (json.dumps(data, indent=1) + "\n").encode())
    return nodes, notes


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kforge_cli.slurm.exclude",
        description="Decide which SLURM nodes a requeued job excludes; print them comma-separated.",
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--from", dest="source", choices=("hang", "straggler", "none"), default="none")
    parser.add_argument("--max", dest="cap", type=int, required=True, help="slurm.max_excluded_nodes")
    parser.add_argument("--need-nodes", type=int, default=None, help="nodes the job needs")
    parser.add_argument("--partition-nodes", default=None, help="nodes in the job's partition (blank: unknown)")
    args = parser.parse_args(argv)
    try:
        nodes, notes = decide(
            args.run_dir,
            args.source,
            cap=args.cap,
            need_nodes=args.need_nodes,
            partition_nodes=_count(args.partition_nodes),
        )
    except (OSError, KforgeError) as exc:
        print(f"kforge: exclusions unchanged: {exc}", file=sys.stderr)
        nodes, notes = [str(n) for n in load(args.run_dir)["nodes"]], []
    for note in notes:
        print(f"kforge: {note}", file=sys.stderr)
    print(",".join(nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
