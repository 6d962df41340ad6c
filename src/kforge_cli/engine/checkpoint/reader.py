"""Reading any DCP checkpoint on one process: no process group, no GPU, no code from the files.

Inspection, verification, export and ``load_model`` all start here. A checkpoint is
opened as a :class:`CheckpointView`: the DCP directories it consists of (the step dir
itself, or one ``pp_S`` directory per pipeline stage), every tensor's global shape,
dtype and shard count from the ``.metadata`` files (read by the restricted unpickler),
and kforge's JSON files when present. Tensors are then read at their *global* shape
with DCP's ``load(no_dist=True)``, which reassembles the shards whatever the world size,
mesh or pipeline split that wrote them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.checkpoint.dcp_io import quiet_single_process, user_error
from kforge_cli.engine.checkpoint.safe_metadata import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.checkpoints import dcp_dirs, is_complete, resolve_checkpoint, step_of
from kforge_cli.rundir.names import COMMIT_FILE, DCP_METADATA, SUMMARY_FILE, TRAIN_STATE_FILE
from kforge_cli.rundir.saved_config import read_saved_config
from kforge_cli.settings.training import ModelSettings

_V = TypeVar("_V")  # what a state dict given to _load holds (tensors, or None for byte items)
MODEL_PREFIX = "model."
DEFAULT_BATCH_BYTES = 512 * 2**20  # tensors read per dcp.load call: bounds memory on huge checkpoints


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint as its metadata describes it (global shape, all shards)."""

    key: str  # DCP key, e.g. "model.layers.0.attention.wq.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: int  # chunks written (one per rank holding a piece)
    source: Path  # the DCP directory holding it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def group(self) -> str:
        """ "model", "optimizer" or "other": the top-level section of the state dict."""
        head = self.key.split(".", 1)[0]
        return head if head in ("model", "optimizer") else "other"


@dataclass
class CheckpointView:
    """An opened checkpoint: where its DCP directories are and what they hold."""

    path: Path
    dcp_dirs: list[Path]
    metadata: dict[Path, Metadata]
    tensors: dict[str, TensorEntry]
    byte_items: dict[str, Path]
    kforge: bool  # written by kforge (step dir with train_state.json / metadata.json)
    complete: bool  # kforge: the commit marker and every .metadata exist; plain DCP: .metadata exists
    summary: dict[str, object] = field(default_factory=dict)  # metadata.json (as read: check before use)
    train_state: dict[str, object] = field(default_factory=dict)  # train_state.json (as read: check before use)

    @property
    def step(self) -> int | None:
        for source in (self.summary, self.train_state):
            step = source.get("step")
            if isinstance(step, int):
                return int(step)
        return step_of(self.path)

    def model_entries(self) -> list[TensorEntry]:
        return [e for e in self.tensors.values() if e.group == "model"]

    def entry(self, name: str) -> TensorEntry:
        """The tensor called `name`: a DCP key, or a model parameter name without the ``model.`` prefix."""
        for key in (name, MODEL_PREFIX + name):
            if key in self.tensors:
                return self.tensors[key]
        close = sorted(k for k in self.tensors if name.split(".")[-1] in k)[:5]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise CheckpointError(f"{self.path} has no tensor {name!r} (list them with `kforge inspect-ckpt PATH`){hint}")


def _guess_dcp_dirs(path: Path) -> list[Path]:
    """DCP directories of a step dir without a (valid) commit marker: itself, or its pp_S stages."""
    if (path / DCP_METADATA).is_file():
        return [path]
    stages = [p for p in path.glob("pp_*") if p.is_dir() and p.name[3:].isdigit()]
    return sorted(stages, key=lambda p: int(p.name[3:]))


def _read_json_if_present(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def open_checkpoint(path: str | Path) -> CheckpointView:
    """Open a kforge step dir, a run dir / checkpoints dir (its newest complete step), or any DCP dir.

    An incomplete kforge checkpoint still opens (``complete`` is False) so it can be
    inspected; loading and export refuse it.
    """
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    kforge = (p / COMMIT_FILE).exists() or (p / TRAIN_STATE_FILE).exists() or (p / SUMMARY_FILE).exists()
    if kforge or step_of(p) is not None:
        complete = is_complete(p)
        dirs = dcp_dirs(p) if complete else _guess_dcp_dirs(p)
        kforge = True
    elif (p / DCP_METADATA).is_file():
        complete, dirs = True, [p]
    else:
        return open_checkpoint(resolve_checkpoint(p))
    if not dirs:
        raise CheckpointError(f"{p} holds no DCP {DCP_METADATA} (its save never finished, or it is not a checkpoint)")
    metadata = {d: read_dcp_metadata(d) for d in dirs}
    tensors: dict[str, TensorEntry] = {}
    byte_items: dict[str, Path] = {}
    for d, md in metadata.items():
        for key, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata) and key not in tensors:
                shape = tuple(int(s) for s in item.size)
                tensors[key] = TensorEntry(key, shape, item.properties.dtype, len(item.chunks), d)
            elif isinstance(item, BytesStorageMetadata):
                byte_items.setdefault(key, d)
    return CheckpointView(
        path=p,
        dcp_dirs=dirs,
        metadata=metadata,
        tensors=tensors,
        byte_items=byte_items,
        kforge=kforge,
        complete=complete,
        summary=_read_json_if_present(p / SUMMARY_FILE),
        train_state=_read_json_if_present(p / TRAIN_STATE_FILE),
    )


def _load(state: dict[str, _V], source: Path, what: str) -> None:
    """``dcp.load`` of a flat {DCP key: tensor} dict from one directory, on this process only."""
    try:
        with quiet_single_process():
            dcp_load(state, storage_reader=SafeFileSystemReader(source), planner=SafeLoadPlanner(source), no_dist=True)
    except CheckpointException as exc:
        inner = user_error(exc)
        if isinstance(inner, KforgeError):
            raise inner from None
        failure = next(iter(exc.failures.values()), None)
        cause = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(f"cannot read {what} from {source}: {type(cause).__name__}: {cause}") from None
    except KforgeError:
        raise
    except Exception as exc:  # a damaged file surfaces as whatever torch.load raises on it
        raise CheckpointError(f"cannot read {what} from {source}: {type(exc).__name__}: {exc}") from None


def read_tensors(
    view: CheckpointView, keys: Iterable[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors for `keys` (DCP keys), in their stored dtype unless `dtype` is given."""
    by_source: dict[Path, dict[str, torch.Tensor]] = {}
    for key in keys:
        e = view.entry(key)
        by_source.setdefault(e.source, {})[e.key] = torch.empty(e.shape, dtype=dtype or e.dtype)
    out: dict[str, torch.Tensor] = {}
    for source, state in by_source.items():
        shown = next(iter(state)) if len(state) == 1 else f"{len(state)} tensors ({next(iter(state))}, ...)"
        _load(state, source, shown)
        out.update(state)
    return out


def batches(entries: Iterable[TensorEntry], budget: int = DEFAULT_BATCH_BYTES) -> Iterator[list[TensorEntry]]:
    """Group entries into batches of at most `budget` bytes (a bigger tensor goes alone)."""
    batch: list[TensorEntry] = []
    size = 0
    for e in entries:
        if batch and size + e.nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch


def iter_tensors(
    view: CheckpointView, keys: Iterable[str], budget: int = DEFAULT_BATCH_BYTES, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, full tensor) for every key, reading about `budget` bytes at a time."""
    for batch in batches((view.entry(k) for k in keys), budget):
        loaded = read_tensors(view, [e.key for e in batch], dtype)
        for e in batch:
            yield e.key, loaded.pop(e.key)


def read_byte_items(view: CheckpointView, keys: Iterable[str]) -> dict[str, object]:
    """Non-tensor items (e.g. optimizer hyper-parameters), unpickled with ``weights_only=True``."""
    by_source: dict[Path, dict[str, object]] = {}
    for key in keys:
        by_source.setdefault(view.byte_items[key], {})[key] = None
    out: dict[str, object] = {}
    for source, state in by_source.items():
        _load(state, source, f"{len(state)} non-tensor item(s)")
        out.update(state)
    return out


def shaping_of(view: CheckpointView) -> dict[str, object]:
    """The model-shaping config a kforge checkpoint was saved with (dotted keys), else from the run's config.toml."""
    for source in (view.train_state.get("shaping"), view.summary.get("model")):
        if isinstance(source, dict) and any(k.startswith(MODEL_PREFIX) for k in source):
            return source
    if view.kforge:
        raw = read_saved_config(view.path.parent.parent, missing_ok=True)
        model = raw.get("model")
        if isinstance(model, dict):
            return {f"{MODEL_PREFIX}{k}": v for k, v in model.items()} | {"vlm": raw.get("vlm")}
    raise CheckpointError(
        f"{view.path} does not say which model it holds (no train_state.json/metadata.json with the model config, "
        "no run config.toml): pass the model settings explicitly, e.g. load_model(path, model_settings=ModelSettings(...))"
    )


def model_settings_of(view: CheckpointView) -> ModelSettings:
    """:class:`ModelSettings` of a kforge checkpoint (``init_std`` is not recorded and only matters at step 0)."""
    shaping = shaping_of(view)
    fields = {k.removeprefix(MODEL_PREFIX): v for k, v in shaping.items() if k.startswith(MODEL_PREFIX)}
    try:
        return ModelSettings.model_validate(fields)
    except Exception as exc:  # a checkpoint from another kforge version with other model fields
        raise CheckpointError(f"{view.path}: its model config does not fit this kforge version ({exc})") from None


def is_vlm(view: CheckpointView) -> bool:
    """True when the checkpoint's config has a ``vlm`` section (a vision-language or MoT model)."""
    try:
        shaping = shaping_of(view)
    except CheckpointError:
        return False
    return shaping.get("vlm") is not None or any(k.startswith("vlm.") for k in shaping)


def metrics_run_ids(train_state: Mapping[str, object]) -> dict[str, str]:
    """The trackers' run ids a checkpoint's train_state.json recorded (``{backend: id}``); what is not a
    string is not an id (the file is read back untrusted)."""
    ids = train_state.get("metrics_run_ids")
    if not isinstance(ids, dict):
        return {}
    return {str(k): v for k, v in ids.items() if isinstance(v, str)}
