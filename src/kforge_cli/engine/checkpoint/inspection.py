"""What is in a checkpoint: a summary, one tensor's statistics, and the difference between two.

Everything here works on one CPU process from the files alone (``reader``), so it runs
on a login node against a checkpoint written by any number of GPUs. Results are plain
dicts/dataclasses: the CLI prints them as text or JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import torch

from kforge_cli.engine.checkpoint.reader import MODEL_PREFIX, CheckpointView, TensorEntry, batches, read_tensors


class TensorRecord(TypedDict):
    """One tensor of a checkpoint as ``inspect-ckpt`` shows it (``--json``: these keys)."""

    name: str
    shape: list[int]
    dtype: str
    numel: int
    bytes: int
    shards: int
    dir: str


class TensorStats(TensorRecord):
    """``inspect-ckpt --tensor``: the record plus statistics over the finite values (None: none finite)."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    norm: float | None
    nan: int
    inf: int
    zeros: int


class GroupTotals(TypedDict):
    tensors: int
    numel: int
    bytes: int


class Totals(TypedDict):
    model: GroupTotals
    optimizer: GroupTotals
    other: GroupTotals
    all: GroupTotals
    files: int
    file_bytes: int


class CheckpointSummary(TypedDict):
    """``inspect-ckpt``'s summary; the values copied from the checkpoint's JSON files stay ``object``
    (whatever the file holds): readers check their types before formatting them."""

    path: str
    format: str
    complete: bool
    file_problems: list[str]
    weights_only: bool
    step: int | None
    tokens_seen: object
    reason: object
    time: object
    world_size: object
    mesh: object
    dcp_dirs: list[str]
    profile: object
    kforge_version: object
    torch_version: object
    fingerprint: object
    model: dict[str, object] | None
    vlm: dict[str, object] | None
    metrics_run_ids: object
    tensors: list[TensorRecord]
    non_tensor_items: int
    totals: Totals


def _totals(entries: list[TensorEntry]) -> GroupTotals:
    return {"tensors": len(entries), "numel": sum(e.numel for e in entries), "bytes": sum(e.nbytes for e in entries)}


def storage_files(view: CheckpointView) -> dict[str, int]:
    """Every shard file the metadata references (relative to the checkpoint) -> its size on disk (-1: missing)."""
    out: dict[str, int] = {}
    for d, md in view.metadata.items():
        for info in (md.storage_data or {}).values():
            path = d / info.relative_path
            rel = str(path.relative_to(view.path)) if path.is_relative_to(view.path) else str(path)
            if rel not in out:
                out[rel] = path.stat().st_size if path.is_file() else -1
    return out


def shard_size_problems(view: CheckpointView) -> tuple[int, list[tuple[Path, str]]]:
    """(shard files named by the metadata, [(DCP dir, problem)]) for files missing or too short.

    Cheap (one stat per file), so the plain listing can tell a truncated copy from a
    complete one; `--verify` also reads every byte back.
    """
    files = 0
    problems: list[tuple[Path, str]] = []
    for d, md in view.metadata.items():
        needed: dict[str, int] = {}
        for info in (md.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        files += len(needed)
        for rel, end in sorted(needed.items()):
            path = d / rel
            if not path.is_file():
                problems.append((d, f"shard file {path} is missing"))
            elif (size := path.stat().st_size) < end:
                problems.append((d, f"shard file {path} is truncated: {size} bytes, its metadata needs {end}"))
    return files, problems


def tensor_record(e: TensorEntry, view: CheckpointView) -> TensorRecord:
    source = str(e.source.relative_to(view.path)) if e.source != view.path else "."
    return {
        "name": e.key,
        "shape": list(e.shape),
        "dtype": str(e.dtype).removeprefix("torch."),
        "numel": e.numel,
        "bytes": e.nbytes,
        "shards": e.shards,
        "dir": source,
    }


def summarize(view: CheckpointView) -> CheckpointSummary:
    """Step, tokens, config summary, run ids, every tensor (shape, dtype, size, shards) and totals."""
    entries = list(view.tensors.values())
    groups = {g: [e for e in entries if e.group == g] for g in ("model", "optimizer", "other")}
    files = storage_files(view)
    found = view.train_state.get("shaping") or view.summary.get("model") or {}
    shaping: dict[str, object] = found if isinstance(found, dict) else {}
    model_cfg = {k.removeprefix(MODEL_PREFIX): v for k, v in shaping.items() if k.startswith(MODEL_PREFIX)}
    return {
        "path": str(view.path),
        "format": "kforge" if view.kforge else "dcp",
        "complete": view.complete,
        "file_problems": [message for _, message in shard_size_problems(view)[1]],
        "weights_only": bool(view.train_state.get("weights_only")),
        "step": view.step,
        "tokens_seen": view.summary.get("tokens_seen"),
        "reason": view.summary.get("reason"),
        "time": view.summary.get("time"),
        "world_size": view.summary.get("world_size"),
        "mesh": view.summary.get("mesh"),
        "dcp_dirs": [str(d.relative_to(view.path)) if d != view.path else "." for d in view.dcp_dirs],
        "profile": view.summary.get("profile"),
        "kforge_version": view.summary.get("kforge_version"),
        "torch_version": view.summary.get("torch_version"),
        "fingerprint": view.summary.get("fingerprint"),
        "model": model_cfg or None,
        "vlm": {
            k: v for k, v in shaping.items() if k.startswith(("vlm", "vision_encoder", "adapter")) and v is not None
        }
        or None,
        "metrics_run_ids": view.train_state.get("metrics_run_ids") or {},
        "tensors": [tensor_record(e, view) for e in entries],
        "non_tensor_items": len(view.byte_items),
        "totals": {
            "model": _totals(groups["model"]),
            "optimizer": _totals(groups["optimizer"]),
            "other": _totals(groups["other"]),
            "all": _totals(entries),
            "files": len(files),
            "file_bytes": sum(max(s, 0) for s in files.values()),
        },
    }


def tensor_stats(view: CheckpointView, name: str) -> TensorStats:
    """Mean, std (population), min, max, L2 norm over the finite values, and NaN / inf counts, of one tensor."""
    e = view.entry(name)
    t = read_tensors(view, [e.key])[e.key]
    values = t.detach().to(torch.float64).flatten()
    nan = int(torch.isnan(values).sum())
    inf = int(torch.isinf(values).sum())
    finite = values[torch.isfinite(values)]
    any_finite = bool(finite.numel())
    return {
        **tensor_record(e, view),
        "mean": float(finite.mean()) if any_finite else None,
        "std": float(finite.std(correction=0)) if any_finite else None,
        "min": float(finite.min()) if any_finite else None,
        "max": float(finite.max()) if any_finite else None,
        "norm": float(finite.norm()) if any_finite else None,
        "nan": nan,
        "inf": inf,
        "zeros": int((values == 0).sum()),
    }


@dataclass
class TensorDiff:
    """How one tensor differs between checkpoints A and B."""

    name: str
    max_abs: float  # max |b - a|
    rel_l2: float  # ||b - a|| / ||a|| (inf when a is all zeros and b is not)
    changed: int  # number of elements that differ


@dataclass
class DiffResult:
    a: str
    b: str
    compared: int = 0
    differing: list[TensorDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    shape_mismatch: list[str] = field(default_factory=list)  # "name: a_shape vs b_shape"

    @property
    def identical(self) -> bool:
        return not (self.differing or self.only_in_a or self.only_in_b or self.shape_mismatch)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "identical": self.identical}


def _compare(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff | None:
    """None when equal (NaN at the same places counts as equal), else by how much they differ."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    both_nan = a64.isnan() & b64.isnan()
    differs = (a64 != b64) & ~both_nan
    changed = int(differs.sum())
    if not changed:
        return None
    delta = torch.where(both_nan, 0.0, b64 - a64)
    norm_a = float(torch.where(both_nan, 0.0, a64).norm())
    norm_d = float(delta.norm())
    rel = norm_d / norm_a if norm_a > 0 else math.inf
    return TensorDiff(name, float(delta.abs().max()), rel, changed)


def diff_checkpoints(a: CheckpointView, b: CheckpointView, *, model_only: bool = False) -> DiffResult:
    """Tensors present in both with the same shape are compared element-wise, one bounded batch at a time."""
    result = DiffResult(str(a.path), str(b.path))

    def keep(k: str) -> bool:
        return not model_only or k.startswith(MODEL_PREFIX)

    keys_a = {k for k in a.tensors if keep(k)}
    keys_b = {k for k in b.tensors if keep(k)}
    result.only_in_a = sorted(keys_a - keys_b)
    result.only_in_b = sorted(keys_b - keys_a)
    common = []
    for k in sorted(keys_a & keys_b):
        if a.tensors[k].shape != b.tensors[k].shape:
            result.shape_mismatch.append(f"{k}: {list(a.tensors[k].shape)} vs {list(b.tensors[k].shape)}")
        else:
            common.append(a.tensors[k])
    for batch in batches(common):
        keys = [e.key for e in batch]
        ta, tb = read_tensors(a, keys), read_tensors(b, keys)
        for k in keys:
            d = _compare(k, ta.pop(k), tb.pop(k))
            if d is not None:
                result.differing.append(d)
        result.compared += len(keys)
    return result
