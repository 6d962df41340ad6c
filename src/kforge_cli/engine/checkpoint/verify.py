"""`inspect-ckpt --verify`: is a checkpoint complete, and can every byte of it be read back?

Checks, cheapest first, and reports every problem rather than stopping at the first:
the commit marker and each DCP ``.metadata``; kforge's JSON and per-rank RNG files;
that every shard file the metadata names exists and is long enough for the byte ranges
it must hold (a truncated copy fails here, naming the file); that the shards of each
tensor cover it; then it reads every tensor and non-tensor item back. Tensors holding
NaN or inf are reported as warnings: readable, but probably not what you want.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.checkpoint.inspection import shard_size_problems
from kforge_cli.engine.checkpoint.layout import COMMIT_FILE, DCP_METADATA, SUMMARY_FILE, TRAIN_STATE_FILE, read_json
from kforge_cli.engine.checkpoint.reader import CheckpointView, batches, open_checkpoint, read_byte_items, read_tensors
from kforge_cli.engine.checkpoint.train_state import load_tensor_file, rank_state_paths
from kforge_cli.errors import KforgeError

log = logging.getLogger("kforge")

_MAX_READ_FAILURES = 10


@dataclass
class VerifyReport:
    path: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    items_read: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _check_kforge_files(view: CheckpointView, report: VerifyReport) -> None:
    p = view.path
    if not (p / COMMIT_FILE).is_file():
        report.problems.append(f"{p / COMMIT_FILE} is missing: the save never finished (or was interrupted)")
    for d in view.dcp_dirs:
        if not (d / DCP_METADATA).is_file():
            report.problems.append(f"{d / DCP_METADATA} is missing")
    state: dict[str, Any] = {}
    for name in (TRAIN_STATE_FILE, SUMMARY_FILE):
        try:
            data = read_json(p / name)
        except KforgeError as exc:
            report.problems.append(str(exc))
            continue
        if name == TRAIN_STATE_FILE:
            state = data
    world = state.get("world_size")
    if state.get("weights_only") or state.get("kind") == "convert-mot":
        world = 0  # weights only (convert-mot's output): complete without optimizer or RNG state
    for rank in range(int(world) if isinstance(world, int) else 0):
        json_path, pt_path = rank_state_paths(p, rank)
        if not json_path.is_file() or not pt_path.is_file():
            report.problems.append(f"RNG state of rank {rank} is missing ({json_path.name} / {pt_path.name})")
            continue
        try:
            read_json(json_path)
            load_tensor_file(pt_path)
        except KforgeError as exc:
            report.problems.append(str(exc))
        except Exception as exc:  # a damaged .pt: torch.load's own error
            report.problems.append(f"{pt_path} is not readable ({type(exc).__name__}: {exc})")


def _check_shard_files(view: CheckpointView, report: VerifyReport) -> set[Path]:
    """Problems with shard files; returns the DCP dirs whose files are all present and long enough."""
    good = set(view.dcp_dirs)
    files, problems = shard_size_problems(view)
    report.files += files
    for d, message in problems:
        report.problems.append(message)
        good.discard(d)
    for e in view.tensors.values():
        chunks = view.metadata[e.source].state_dict_metadata[e.key].chunks  # type: ignore[union-attr]
        covered = sum(int(torch.Size(c.sizes).numel()) for c in chunks)
        if covered != e.numel:
            report.problems.append(f"{e.key}: its {len(chunks)} shard(s) hold {covered} of {e.numel} elements")
    return good


def _read_back(view: CheckpointView, dirs: set[Path], report: VerifyReport) -> None:
    failures = 0
    for batch in batches(e for e in view.tensors.values() if e.source in dirs):
        keys = [e.key for e in batch]
        try:
            loaded = read_tensors(view, keys)
        except KforgeError:
            loaded = {}
            for k in keys:  # find which ones
                try:
                    loaded.update(read_tensors(view, [k]))
                except KforgeError as exc:
                    failures += 1
                    if failures <= _MAX_READ_FAILURES:
                        report.problems.append(str(exc))
        for k, t in loaded.items():
            report.tensors_read += 1
            report.bytes_read += t.numel() * t.element_size()
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                report.warnings.append(f"{k} holds {int(t.isnan().sum())} NaN and {int(t.isinf().sum())} inf values")
    if failures > _MAX_READ_FAILURES:
        report.problems.append(f"... and {failures - _MAX_READ_FAILURES} more unreadable tensors")
    items = [k for k, d in view.byte_items.items() if d in dirs]
    try:
        report.items_read += len(read_byte_items(view, items))
    except KforgeError as exc:
        report.problems.append(str(exc))


def verify_checkpoint(path: str | Path) -> VerifyReport:
    """Every check above; `report.ok` is True only when the checkpoint can be resumed from as it is."""
    report = VerifyReport(str(Path(path).expanduser().resolve()))
    try:
        view = open_checkpoint(path)
    except KforgeError as exc:
        report.problems.append(str(exc))
        return report
    report.path = str(view.path)
    if view.kforge:
        _check_kforge_files(view, report)
    good = _check_shard_files(view, report)
    _read_back(view, good, report)
    return report
