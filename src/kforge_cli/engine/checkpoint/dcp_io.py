"""Model and optimizer state through Distributed Checkpoint.

State dicts come from ``get_state_dict`` (FQN keys without wrapper prefixes, optimizer
state keyed by parameter name and flattened, so a checkpoint reshards across world
sizes, meshes and pipeline splits) and go back through ``set_state_dict``. Loading
reads the subset of keys each DCP directory holds, so a checkpoint saved with one
pipeline split (one directory per stage) loads into another, or into no pipeline.

Throughput: a save writes one shard file per writer thread (``checkpoint.write_threads``),
so serialisation (torch.save's CRC and framing) overlaps the disk, and every file is
fsynced before ``.metadata`` names it. A load reads a rank's items on several threads
(``checkpoint.load_threads``). Async saves stage through one ``staging.HostStager``
whose host buffers are allocated at the first save and refilled in place afterwards.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.futures import Future

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.checkpoint.safe_metadata import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from kforge_cli.errors import KforgeError
from kforge_cli.settings.infrastructure import CheckpointSettings

log = logging.getLogger("kforge")

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MB = 2**20
_LOAD_THREADS = 4  # default for readers built without settings (checkpoint.load_threads)


def shard_writer(path: Path, cfg: CheckpointSettings) -> FileSystemWriter:
    """The DCP writer of one save: `write_threads` files per rank, each fsynced (durability is kept).

    Contiguous CPU tensors are written from their own memory (DCP's serial loader copies
    only a view whose storage is larger than the tensor); GPU tensors are copied to the
    host `copy_ahead_mb` ahead of the write on a single-thread writer.
    """
    return FileSystemWriter(
        path,
        sync_files=True,
        thread_count=cfg.write_threads,
        per_thread_copy_ahead=cfg.copy_ahead_mb * MB,
        cache_staged_state_dict=False,
    )


class ParallelReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` that reads a rank's items on several threads (balanced by bytes).

    Each thread runs the parent's ``read_data`` on its share of the plan, so every byte
    still goes through the same reading and checks; file reads and ``torch.load`` of the
    item release the GIL, so threads overlap the disk with deserialisation and copies.
    Only this rank's items are in the plan: a rank reads and holds just its shards.
    """

    def __init__(self, path: Path, threads: int = _LOAD_THREADS) -> None:
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        n = min(self.threads, len(plan.items))
        if n <= 1:
            return super().read_data(plan, planner)
        bins: list[list[ReadItem]] = [[] for _ in range(n)]
        sizes = [0] * n
        for item in sorted(plan.items, key=lambda i: -self.storage_data[i.storage_index].length):
            idx = sizes.index(min(sizes))
            bins[idx].append(item)
            sizes[idx] += self.storage_data[item.storage_index].length
        parent = super()
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="kforge-ckpt-read") as pool:
            parts = [pool.submit(parent.read_data, dataclasses.replace(plan, items=b), planner) for b in bins]
            for part in parts:
                part.result().wait()  # re-raises the first failure of a thread
        done: Future[None] = Future()
        done.set_result(None)
        return done


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that a process without a process group saves/loads alone (that is intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def training_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` for DCP (sharded tensors stay sharded)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_sd, "optimizer": optim_sd}


def apply_training_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=OPTIONS
    )


def state_nbytes(state: Mapping[str, object]) -> int:
    """Bytes of this rank's tensors in a (nested) state dict (local shards for DTensors)."""
    total = 0
    stack: list[object] = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item  # type: ignore[operator]
            total += local.numel() * local.element_size()
    return total


def _flat(state: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """DCP key ("model.layers.0.w") -> (section, key) for the two-level state dict."""
    return {f"{section}.{key}": (section, key) for section, sub in state.items() for key in sub}


def _check_shapes(state: dict[str, Any], md: Metadata, source: Path) -> None:
    bad = []
    for flat_key, (section, key) in _flat(state).items():
        entry = md.state_dict_metadata.get(flat_key)
        value = state[section][key]
        tensor = isinstance(entry, TensorStorageMetadata) and isinstance(value, torch.Tensor)
        if tensor and tuple(entry.size) != tuple(value.shape):  # type: ignore[union-attr]
            shown = key if section == "model" else flat_key
            bad.append(f"{shown}: checkpoint {tuple(entry.size)}, this model {tuple(value.shape)}")  # type: ignore[union-attr]
    if bad:
        shown = "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        raise CheckpointError(f"{source} does not fit this model: {shown}")


def load_from_dirs(
    state: dict[str, Any], dirs: Iterable[Path], group: ProcessGroup | None = None, threads: int = _LOAD_THREADS
) -> set[str]:
    """Fill `state` in place from every DCP dir holding some of its keys; returns the DCP keys not found.

    Every rank of `group` must hold the same keys (true within a pipeline stage).
    """
    missing = set(_flat(state))
    no_dist = not (dist.is_available() and dist.is_initialized())
    for path in dirs:
        md = read_dcp_metadata(path)
        present = missing & set(md.state_dict_metadata)
        if not present:
            continue
        flat = _flat(state)
        sub: dict[str, dict[str, Any]] = {}
        for k in sorted(present):
            section, key = flat[k]
            sub.setdefault(section, {})[key] = state[section][key]
        _check_shapes(sub, md, path)
        try:
            with quiet_single_process():
                dcp_load(
                    sub,
                    storage_reader=ParallelReader(path, threads),
                    planner=SafeLoadPlanner(path),
                    process_group=group,
                    no_dist=no_dist,
                )
        except CheckpointException as exc:
            raise user_error(exc) from None
        for section, values in sub.items():
            state[section].update(values)  # non-tensor items are replaced, not filled in place
        missing -= present
    return missing


def user_error(exc: CheckpointException) -> BaseException:
    """The KforgeError a rank raised inside DCP (DCP wraps every rank's failure), else `exc` itself."""
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, KforgeError):
            return inner
    return exc


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or name.startswith(p.rstrip(".") + ".") or name == p for p in patterns)


def load_model_weights(
    model: nn.Module, dirs: list[Path], exclude: list[str], group: ProcessGroup | None = None
) -> list[str]:
    """Warm start: load the model's weights (not the optimizer) except names matching `exclude`.

    Patterns are fnmatch globs (``output.*``) or module prefixes (``layers.0``) on
    parameter names. Returns the names loaded. A parameter missing from the checkpoint
    is an error naming it, unless excluded.
    """
    full = get_model_state_dict(model, options=OPTIONS)
    wanted = {k: v for k, v in full.items() if not _excluded(k, exclude)}
    skipped = sorted(set(full) - set(wanted))
    if skipped:
        log.info(
            "warm start: not loading %d tensor(s) matching checkpoint.exclude_from_loading: %s",
            len(skipped),
            ", ".join(skipped[:8]) + (" ..." if len(skipped) > 8 else ""),
        )
    state = {"model": wanted}
    missing = load_from_dirs(state, dirs, group)
    if missing:
        names = sorted(m.removeprefix("model.") for m in missing)
        shown = ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
        raise CheckpointError(
            f"checkpoint {dirs[0].parent if len(dirs) > 1 else dirs[0]} has no weights for {shown}; "
            "list them in checkpoint.exclude_from_loading to keep their fresh initialisation"
        )
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    return sorted(wanted)
