"""The stateful training loader: micro-batches forever, and a state that resumes exactly.

The sample order is a pure function of a :class:`Cursor`, so the loader's state is that
cursor (plus what it was computed for, to refuse an incompatible resume). With
``num_workers > 0`` a torch ``DataLoader`` reads windows in worker processes from a
request stream that starts at the cursor; each batch carries the cursor *after* it,
and the loader records it only when the batch is handed out. Batches prefetched but
not consumed before a checkpoint are therefore simply produced again after a resume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import NotRequired, Protocol, TypedDict, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from kforge_cli.common.json_values import int_of
from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.sampler import BatchPlan, Cursor, SampleOrder
from kforge_cli.engine.data.tokens import Windows, make_batch
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.data_fingerprint import changed_data_message
from kforge_cli.rundir.data_fingerprint import describe as describe_prints
from kforge_cli.settings.data import DataSettings
from kforge_cli.settings.training import TrainSettings

log = logging.getLogger(__name__)

STATE_VERSION = 1


class DataStateError(KforgeError):
    """A checkpoint's data-loader state cannot continue this run's data order."""


class Fetch(Protocol):
    """Builds the batch dict of the samples a plan names (the text `BatchFetcher`, the VLM caption batcher)."""

    def __call__(self, dataset_ids: np.ndarray, indices: np.ndarray, /) -> dict[str, torch.Tensor]: ...


class BatchFetcher:
    """Reads the windows a plan names and builds the batch dict (runs in workers too)."""

    def __init__(self, windows: Sequence[Windows], eos_id: int, document_masking: bool) -> None:
        self.windows = list(windows)
        self.eos_id = eos_id
        self.document_masking = document_masking

    def __call__(self, dataset_ids: np.ndarray, window_ids: np.ndarray) -> dict[str, torch.Tensor]:
        rows = np.empty((len(window_ids), self.windows[0].seq_len + 1), dtype=np.int64)
        for d in np.unique(dataset_ids).tolist():
            sel = dataset_ids == d
            rows[sel] = self.windows[d].rows(window_ids[sel])
        return make_batch(rows, dataset_ids, self.eos_id, self.document_masking)


class _PlanStream:
    """The sampler handed to DataLoader: one request per micro-batch, from a cursor on."""

    def __init__(self, order: SampleOrder, cursor: Cursor) -> None:
        self.order, self.cursor = order, cursor

    def __iter__(self) -> Iterator[BatchPlan]:
        cursor = self.cursor
        while True:
            plan = self.order.next_batch(cursor)
            cursor = plan.after
            yield plan


class _FetchDataset(Dataset[tuple[dict[str, torch.Tensor], Cursor]]):
    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch

    def __getitem__(self, plan: BatchPlan) -> tuple[dict[str, torch.Tensor], Cursor]:  # type: ignore[override]
        return self.fetch(plan.dataset_ids, plan.windows), plan.after


_T = TypeVar("_T")


def _as_is(item: _T) -> _T:
    return item


def pin_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with its tensors in page-locked memory, so ``.to(cuda, non_blocking=True)`` is really
    asynchronous (from pageable memory the copy waits for the host buffer to be staged)."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class LoaderState(TypedDict):
    """``StatefulLoader.state_dict()``: the position (a ``Cursor``) and the facts a resume checks."""

    version: int
    batch: int
    sample: int
    counts: list[int]
    epochs: list[int]
    dataset_names: list[str]
    dataset_windows: list[int]
    seq_len: int
    data_seed: int
    batch_size: int
    dp_size: int
    grad_accum_steps: int
    dataset_fingerprints: NotRequired[list[str]]  # rundir.data_fingerprint; absent in older checkpoints


class StatefulLoader:
    """``iter()`` yields this rank's micro-batches forever; ``state_dict()`` resumes exactly."""

    def __init__(
        self,
        order: SampleOrder,
        fetch: Fetch,
        *,
        seq_len: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        fingerprints: list[str] | None = None,
        allow_changed_data: bool = False,
    ) -> None:
        self.order, self.fetch, self.seq_len = order, fetch, seq_len
        self.fingerprints, self.allow_changed_data = fingerprints, allow_changed_data
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.cursor = Cursor.start(len(order.names))

    @property
    def step(self) -> int:
        """Optimizer step of the next micro-batch."""
        return self.order.step_of(self.cursor)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.num_workers == 0:
            while True:
                plan = self.order.next_batch(self.cursor)
                batch = self.fetch(plan.dataset_ids, plan.windows)
                self.cursor = plan.after
                yield pin_batch(batch) if self.pin_memory else batch  # DataLoader pins only with workers
        loader = DataLoader(
            _FetchDataset(self.fetch),
            sampler=_PlanStream(self.order, self.cursor),  # type: ignore[arg-type]
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            collate_fn=_as_is,
        )
        for batch, after in loader:
            self.cursor = after
            yield batch

    def state_dict(self) -> LoaderState:
        """JSON-serialisable position plus the facts a resume must agree with."""
        o = self.order
        state: LoaderState = {
            "version": STATE_VERSION,
            "batch": self.cursor.batch,
            "sample": self.cursor.sample,
            "counts": list(self.cursor.counts),
            "epochs": [c // n for c, n in zip(self.cursor.counts, o.num_windows, strict=True)],
            "dataset_names": list(o.names),
            "dataset_windows": list(o.num_windows),
            "seq_len": self.seq_len,
            "data_seed": o.seed,
            "batch_size": o.batch_size,
            "dp_size": o.dp_size,
            "grad_accum_steps": o.grad_accum_steps,
        }
        if self.fingerprints is not None:
            state["dataset_fingerprints"] = list(self.fingerprints)
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue from ``state``; call before iterating. Refuses a state for other data."""
        o = self.order
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataStateError(f"data loader state has version {state.get('version')!r}, expected {STATE_VERSION}")
        fixed = {
            "dataset_names": list(o.names),
            "dataset_windows": list(o.num_windows),
            "seq_len": self.seq_len,
            "data_seed": o.seed,
        }
        theirs = state.get("dataset_fingerprints")
        if isinstance(theirs, list) and self.fingerprints is not None and theirs != self.fingerprints:
            if not self.allow_changed_data:
                raise DataStateError(changed_data_message(theirs, self.fingerprints, list(o.names)))
            log.warning(
                "continuing on changed data (data.allow_changed_data): the checkpoint trained on %s, this run has %s; "
                "the data order continues at the same position, not exactly",
                describe_prints(theirs, list(o.names)),
                describe_prints(self.fingerprints, list(o.names)),
            )
            fixed.pop("dataset_windows")
        for key, ours in fixed.items():
            if state.get(key) != ours:
                raise DataStateError(
                    f"the checkpoint's data order was for {key}={state.get(key)!r}, this run has {ours!r}: "
                    "the data order cannot continue exactly. Restore the original data settings, or start "
                    "from the weights only (checkpoint.init_from) to begin a fresh data order."
                )
        batch = int_of(state["batch"])
        old_accum = int_of(state["grad_accum_steps"])
        if old_accum != o.grad_accum_steps:
            if batch % old_accum:
                raise DataStateError(
                    f"the checkpoint stopped mid-step ({batch} micro-batches, grad_accum_steps {old_accum}); "
                    f"cannot change train.grad_accum_steps to {o.grad_accum_steps} from there"
                )
            batch = batch // old_accum * o.grad_accum_steps
        if (state["dp_size"], state["batch_size"]) != (o.dp_size, o.batch_size):
            log.info(
                "data order re-partitioned: dp_size %s -> %s, batch_size %s -> %s, continuing at global sample %s",
                state["dp_size"],
                o.dp_size,
                state["batch_size"],
                o.batch_size,
                state["sample"],
            )
        counts = state["counts"]
        if not isinstance(counts, list | tuple):
            raise TypeError(f"data loader state: counts is {counts!r}, not a list")
        self.cursor = Cursor(batch, int_of(state["sample"]), tuple(int_of(c) for c in counts))


def training_loader(
    train: TrainSettings,
    data: DataSettings,
    names: list[str],
    sizes: list[int],
    schedule: MixtureSchedule,
    fetch: Fetch,
    *,
    seed: int,
    seq_len: int,
    dp_rank: int,
    dp_size: int,
    fingerprints: list[str] | None = None,
) -> StatefulLoader:
    """The resumable loader of one data-parallel rank over datasets of ``sizes`` samples each.

    ``train`` gives the batch size and accumulation, ``data`` the workers, prefetch and pinning;
    ``seed`` is the data order's seed (``JobSettings.data_seed``).
    """
    order = SampleOrder(
        names,
        sizes,
        schedule,
        seed=seed,
        batch_size=train.batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        grad_accum_steps=train.grad_accum_steps,
    )
    return StatefulLoader(
        order,
        fetch,
        seq_len=seq_len,
        num_workers=data.num_workers,
        prefetch_factor=data.prefetch_factor,
        pin_memory=data.pin_memory,
        fingerprints=fingerprints,
        allow_changed_data=data.allow_changed_data,
    )
