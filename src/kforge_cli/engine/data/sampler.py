"""The deterministic, distributed sample order.

All ranks share one *global* stream of samples. Micro-batch ``m`` of the job takes the
next ``batch_size * dp_size`` global positions; data-parallel rank ``r`` gets the
``r``-th contiguous slice of ``batch_size`` of them. Each global position is assigned

1. a dataset, by comparing a low-discrepancy 64-bit value of the position with the
   mixture's cut points at the current optimizer step (``m // grad_accum_steps``);
2. the next ordinal of that dataset, and through it a window: ordinal ``c`` of a
   dataset with ``N`` windows is window ``permute(c % N)`` of epoch ``c // N``, a
   pseudo-random permutation keyed by (data_seed, dataset name, epoch).

So the union over ranks of the first ``N`` samples of a single dataset is exactly its
``N`` windows (no duplicates, no gaps), epochs roll over seamlessly, and the position
in the stream is a handful of counters (:class:`Cursor`). Because the stream does not
depend on the number of ranks, a resume with a different ``dp_size`` continues it at
the same global position: nothing is repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.permutation import derive_key, permute, weyl_uniform


@dataclass(frozen=True)
class Cursor:
    """Position in the global stream: micro-batches per rank, global samples, draws per dataset."""

    batch: int
    sample: int
    counts: tuple[int, ...]

    @classmethod
    def start(cls, num_datasets: int) -> Cursor:
        return cls(0, 0, (0,) * num_datasets)


@dataclass(frozen=True)
class BatchPlan:
    """What one rank reads for one micro-batch, and where the stream is after it."""

    dataset_ids: np.ndarray  # [batch_size] index into the dataset list
    windows: np.ndarray  # [batch_size] window index within that dataset
    after: Cursor


class SampleOrder:
    """Pure function from a cursor to this rank's next micro-batch (see module docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        num_windows: Sequence[int],
        schedule: MixtureSchedule,
        *,
        seed: int,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        grad_accum_steps: int = 1,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        if min(num_windows) < 1:
            raise ValueError("every dataset needs at least one window")
        self.names = tuple(names)
        self.num_windows = tuple(int(n) for n in num_windows)
        self.schedule = schedule
        self.seed = seed
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.grad_accum_steps = grad_accum_steps
        self._mix_key = derive_key("mixture", seed)

    def step_of(self, cursor: Cursor) -> int:
        """The optimizer step the cursor's next micro-batch belongs to."""
        return cursor.batch // self.grad_accum_steps

    def _choose_datasets(self, positions: np.ndarray, step: int) -> np.ndarray:
        if len(self.names) == 1:
            return np.zeros(len(positions), dtype=np.int64)
        cuts = self.schedule.thresholds_at(step)
        return np.searchsorted(cuts, weyl_uniform(positions, self._mix_key), side="right").astype(np.int64)

    def window_of(self, dataset: int, ordinals: np.ndarray) -> np.ndarray:
        """Window indices of a dataset's draws number ``ordinals`` (epochs roll over)."""
        n = self.num_windows[dataset]
        epochs = ordinals // n
        out = np.empty_like(ordinals)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            key = derive_key("order", self.seed, self.names[dataset], epoch)
            out[sel] = permute(ordinals[sel] % n, n, key)
        return out

    def _group(self, cursor: Cursor) -> tuple[np.ndarray, np.ndarray, Cursor]:
        """Dataset and ordinal of every sample of the cursor's micro-batch on all ranks, and the cursor after it."""
        group = self.batch_size * self.dp_size
        positions = cursor.sample + np.arange(group, dtype=np.int64)
        ds = self._choose_datasets(positions, self.step_of(cursor))
        n_ds = len(self.names)
        onehot = ds[:, None] == np.arange(n_ds)[None, :]
        rank_in_ds = np.cumsum(onehot, axis=0)[np.arange(group), ds] - 1
        ordinals = np.asarray(cursor.counts, dtype=np.int64)[ds] + rank_in_ds
        counts = tuple(int(c) for c in np.asarray(cursor.counts) + onehot.sum(axis=0))
        after = replace(cursor, batch=cursor.batch + 1, sample=cursor.sample + group, counts=counts)
        return ds, ordinals, after

    def _windows(self, ds: np.ndarray, ordinals: np.ndarray) -> np.ndarray:
        windows = np.empty_like(ordinals)
        for d in np.unique(ds).tolist():
            sel = ds == d
            windows[sel] = self.window_of(d, ordinals[sel])
        return windows

    def next_batch(self, cursor: Cursor) -> BatchPlan:
        """This rank's samples of the cursor's micro-batch."""
        ds, ordinals, after = self._group(cursor)
        mine = slice(self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size)
        return BatchPlan(ds[mine], self._windows(ds[mine], ordinals[mine]), after)

    def group_batch(self, cursor: Cursor) -> BatchPlan:
        """Every data-parallel rank's samples of the cursor's micro-batch: rank ``r``'s are
        ``[r * batch_size, (r + 1) * batch_size)`` (what ``next_batch`` gives rank ``r``)."""
        ds, ordinals, after = self._group(cursor)
        return BatchPlan(ds, self._windows(ds, ordinals), after)

    def advance(self, cursor: Cursor, micro_batches: int) -> Cursor:
        """The cursor ``micro_batches`` micro-batches on: what as many ``next_batch`` calls reach, in
        large vectorised chunks and without choosing windows (``kforge data-trace`` replays a run)."""
        if micro_batches < 0:
            raise ValueError(f"cannot advance by {micro_batches} micro-batches")
        group = self.batch_size * self.dp_size
        counts = np.asarray(cursor.counts, dtype=np.int64).copy()
        end = cursor.batch + micro_batches
        if len(self.names) == 1:
            counts[0] += micro_batches * group
        batch = cursor.batch
        starts = sorted({start for start, _ in self.schedule.phases})
        chunk = max(1, (1 << 20) // group)  # micro-batches per numpy pass
        while len(self.names) > 1 and batch < end:
            step = batch // self.grad_accum_steps
            # the dataset probabilities change only where a phase starts: one pass per run of equal ones
            change = next((s * self.grad_accum_steps for s in starts if s > step), end)
            stop = min(end, change, batch + chunk)
            first = cursor.sample + (batch - cursor.batch) * group
            positions = first + np.arange((stop - batch) * group, dtype=np.int64)
            counts += np.bincount(self._choose_datasets(positions, step), minlength=len(self.names))
            batch = stop
        return Cursor(end, cursor.sample + micro_batches * group, tuple(int(c) for c in counts))
