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

    def next_batch(self, cursor: Cursor) -> BatchPlan:
        group = self.batch_size * self.dp_size
        positions = cursor.sample + np.arange(group, dtype=np.int64)
        ds = self._choose_datasets(positions, self.step_of(cursor))
        n_ds = len(self.names)
        onehot = ds[:, None] == np.arange(n_ds)[None, :]
        rank_in_ds = np.cumsum(onehot, axis=0)[np.arange(group), ds] - 1
        ordinals = np.asarray(cursor.counts, dtype=np.int64)[ds] + rank_in_ds
        mine = slice(self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size)
        my_ds, my_ord = ds[mine], ordinals[mine]
        windows = np.empty_like(my_ord)
        for d in np.unique(my_ds).tolist():
            sel = my_ds == d
            windows[sel] = self.window_of(d, my_ord[sel])
        counts = tuple(int(c) for c in np.asarray(cursor.counts) + onehot.sum(axis=0))
        after = replace(cursor, batch=cursor.batch + 1, sample=cursor.sample + group, counts=counts)
        return BatchPlan(my_ds, windows, after)
