"""Train state without pickle: JSON for numbers and structure, tensors loaded with weights_only.

Global state (written once, by rank 0) goes to ``train_state.json``; the RNG state of
every rank goes to ``train_state/rank_R.json`` (python, numpy scalars) and
``train_state/rank_R.pt`` (torch CPU and CUDA generators, numpy's key array: tensors
only, read back with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from kforge_cli.engine.checkpoint.safe_metadata import weights_only_reason
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.checkpoints import atomic_write_bytes, atomic_write_json, read_json
from kforge_cli.rundir.names import RANK_STATE_DIR

log = logging.getLogger("kforge")

FORMAT = 1
# What a resume reads from train_state.json without a default; checked before a checkpoint is chosen.
TRAIN_STATE_SCHEMA: dict[str, type] = {
    "format": int,
    "step": int,
    "progress": dict,
    "scheduler": dict,
    "fingerprint": str,
    "world_size": int,
}
_RNG_TENSORS = ("torch_cpu", "numpy_keys")


def capture_rng() -> tuple[dict[str, object], dict[str, torch.Tensor | list[torch.Tensor]]]:
    """(JSON part, tensor part) of this process's python, numpy, torch CPU and CUDA generators."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    json_part: dict[str, object] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {"name": name, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    tensors: dict[str, torch.Tensor | list[torch.Tensor]] = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = list(torch.cuda.get_rng_state_all())
    return json_part, tensors


def restore_rng(json_part: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Put every generator back exactly where `capture_rng` found it."""
    py = json_part["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    npj = json_part["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((npj["name"], keys, int(npj["pos"]), int(npj["has_gauss"]), float(npj["cached_gaussian"])))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = tensors.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "checkpoint has %d CUDA generators, this node %d: CUDA RNG not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
        else:
            torch.cuda.set_rng_state_all(cuda)


def rank_state_paths(step_dir: Path, rank: int) -> tuple[Path, Path]:
    base = step_dir / RANK_STATE_DIR / f"rank_{rank}"
    return base.with_suffix(".json"), base.with_suffix(".pt")


def write_rank_state(step_dir: Path, rank: int) -> None:
    """This rank's RNG state, durably (called before the DCP save starts)."""
    json_path, pt_path = rank_state_paths(step_dir, rank)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_part, tensors = capture_rng()
    buf = io.BytesIO()
    torch.save(tensors, buf)
    atomic_write_bytes(pt_path, buf.getvalue())
    atomic_write_json(json_path, {"format": FORMAT, "rank": rank, "rng": json_part})


def load_tensor_file(path: Path) -> object:
    """``torch.load(weights_only=True)``: a file with anything but tensors and containers is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it holds more than tensors ({weights_only_reason(exc)}), so it could run "
            "code. Use only checkpoints you trust; kforge writes tensors only there."
        ) from None
    except Exception as exc:  # truncated or garbage: whatever torch.load raises on it
        raise CheckpointError(f"{path} is not readable ({type(exc).__name__}: {exc})") from None


def train_state_problems(state: Mapping[str, object], path: Path) -> list[str]:
    """What `train_state.json` lacks for a resume (a missing or mistyped key), empty when usable."""
    problems = []
    for key, kind in TRAIN_STATE_SCHEMA.items():
        value = state.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            shown = "missing" if key not in state else f"a {type(value).__name__}"
            problems.append(f"{path}: {key!r} is {shown}, expected a {kind.__name__}")
    return problems


def _rng_problem(record: Mapping[str, object], tensors: object, json_path: Path, pt_path: Path) -> str | None:
    rng = record.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("python"), dict) or not isinstance(rng.get("numpy"), dict):
        return f"{json_path} does not hold kforge RNG state (no rng.python / rng.numpy)"
    if not isinstance(tensors, dict) or not all(isinstance(tensors.get(k), torch.Tensor) for k in _RNG_TENSORS):
        return f"{pt_path} does not hold kforge RNG state ({' and '.join(_RNG_TENSORS)} tensors)"
    return None


def read_rank_state(step_dir: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(JSON part, tensors) of `rank`'s RNG state, or None when the checkpoint has no file for it."""
    json_path, pt_path = rank_state_paths(step_dir, rank)
    if not json_path.is_file() or not pt_path.is_file():
        return None
    record = read_json(json_path)
    tensors = load_tensor_file(pt_path)
    problem = _rng_problem(record, tensors, json_path, pt_path)
    if problem:
        raise CheckpointError(problem)
    rng = record["rng"]
    assert isinstance(tensors, dict) and isinstance(rng, dict)  # _rng_problem checked both
    return rng, tensors


_LIST_MISSING = 16  # more missing ranks than this are one line, not one each
_RANK_FILE = re.compile(r"rank_(0|[1-9][0-9]{0,8})\.(json|pt)\Z")


def _ranks_present(step_dir: Path, world_size: int) -> set[int]:
    """Ranks below `world_size` with both RNG files in the checkpoint, from one directory scan."""
    seen: dict[int, set[str]] = {}
    try:
        entries = list(os.scandir(step_dir / RANK_STATE_DIR))
    except OSError:
        return set()
    for entry in entries:
        match = _RANK_FILE.match(entry.name)
        if match and int(match.group(1)) < world_size and entry.is_file():
            seen.setdefault(int(match.group(1)), set()).add(match.group(2))
    return {rank for rank, kinds in seen.items() if kinds == {"json", "pt"}}


def rank_state_problems(step_dir: Path, world_size: int, *, strict: bool = False) -> list[str]:
    """Missing or unreadable per-rank RNG files of a checkpoint saved by `world_size` ranks.

    `strict`: a file that could carry code raises instead of being listed (resume refuses it).
    """
    problems = []
    present = _ranks_present(step_dir, world_size)  # bounded by the files there, not by what the record claims
    absent = world_size - len(present)
    if absent > _LIST_MISSING:
        problems.append(
            f"RNG state of {absent} of the {world_size} ranks train_state.json names is missing "
            f"({step_dir / RANK_STATE_DIR} holds files of {len(present)})"
        )
    elif absent:
        for rank in sorted(set(range(world_size)) - present):
            json_path, pt_path = rank_state_paths(step_dir, rank)
            problems.append(f"RNG state of rank {rank} is missing ({json_path.name} / {pt_path.name})")
    for rank in sorted(present):
        json_path, pt_path = rank_state_paths(step_dir, rank)
        try:
            read_rank_state(step_dir, rank)
        except UnsafeCheckpointError as exc:
            if strict:
                raise
            problems.append(str(exc))
        except KforgeError as exc:
            problems.append(str(exc))
    return problems
