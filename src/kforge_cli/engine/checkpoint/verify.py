"""`inspect-ckpt --verify`: is a checkpoint complete, and can every byte of it be read back?

Checks, cheapest first, and reports every problem rather than stopping at the first:
the commit marker and each DCP ``.metadata``; kforge's JSON and per-rank RNG files;
that every shard file the metadata names exists and is long enough for the byte ranges
it must hold (a truncated copy fails here, naming the file), and opening the metadata
already checked that the shards of each tensor cover it; then it reads every tensor and non-tensor item back. Tensors holding
NaN or inf are reported as warnings: readable, but probably not what you want.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kforge_cli.engine.checkpoint.checkpoint_errors import UnsafeCheckpointError
from kforge_cli.engine.checkpoint.metadata_checks import storage_file_problems
from kforge_cli.engine.checkpoint.reader import CheckpointView, batches, open_checkpoint, read_byte_items, read_tensors
from kforge_cli.engine.checkpoint.safe_metadata import read_dcp_metadata
from kforge_cli.engine.checkpoint.train_state import rank_state_problems, train_state_problems
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.checkpoints import commit_problem, dcp_dirs, read_json
from kforge_cli.rundir.names import SUMMARY_FILE, TRAIN_STATE_FILE

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

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def _weights_only(state: Mapping[str, object]) -> bool:
    """convert-mot's output (and any weights-only checkpoint): complete without optimizer or RNG state."""
    return bool(state.get("weights_only")) or state.get("kind") == "convert-mot"


def kforge_file_problems(step_dir: Path, *, strict: bool = False) -> list[str]:
    """The commit marker, train_state.json's schema, metadata.json and every rank's RNG files.

    `strict`: a file that could carry code raises :class:`UnsafeCheckpointError` instead.
    """
    _, problem = commit_problem(step_dir)
    problems = [problem] if problem else []
    state: dict[str, object] = {}
    for name in (TRAIN_STATE_FILE, SUMMARY_FILE):
        try:
            data = read_json(step_dir / name)
        except KforgeError as exc:
            problems.append(str(exc))
            continue
        if name == TRAIN_STATE_FILE:
            state = data
            if not _weights_only(data):  # a weights-only checkpoint warm-starts; it has no resume state
                problems += train_state_problems(data, step_dir / name)
    world = state.get("world_size")
    if _weights_only(state):
        world = 0  # weights only (convert-mot's output): complete without optimizer or RNG state
    if isinstance(world, int) and not isinstance(world, bool) and world > 0:
        problems += rank_state_problems(step_dir, world, strict=strict)
    return problems


def damage(step_dir: Path) -> str | None:
    """Why a committed checkpoint cannot be resumed as it is (no tensor is read), or None.

    Resume runs this on the checkpoint it is about to choose, so that a damaged one is
    skipped for the previous complete one instead of failing mid-restore. A file that could
    carry code is not damage: :class:`UnsafeCheckpointError` propagates and resume refuses.
    """
    problems = kforge_file_problems(step_dir, strict=True)
    if not problems:
        for d in dcp_dirs(step_dir):
            try:
                problems += storage_file_problems(read_dcp_metadata(d), d)
            except UnsafeCheckpointError:
                raise
            except KforgeError as exc:
                problems.append(str(exc))
    if not problems:
        return None
    return "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")


def _check_shard_files(view: CheckpointView, report: VerifyReport) -> set[Path]:
    """Problems with shard files; returns the DCP dirs whose files are all present and long enough."""
    good = set(view.dcp_dirs)
    for d, md in view.metadata.items():
        report.files += len({str(info.relative_path) for info in (md.storage_data or {}).values()})
        problems = storage_file_problems(md, d)
        report.problems += problems
        if problems:
            good.discard(d)
    return good  # chunk coverage and shape-vs-bytes were checked when the metadata was opened


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
        report.problems += kforge_file_problems(view.path)
    good = _check_shard_files(view, report)
    _read_back(view, good, report)
    return report
