"""Count the reads of tensor values by the host (each one a device sync on a GPU) while code runs.

On CPU nothing syncs, but every call that *would* wait for the GPU goes through one of the
`Tensor` methods patched here (``item``, ``float()``, ``int()``, ``bool()``, ``tolist``,
``cpu``, ``numpy``), so counting them measures the host syncs of a step without a GPU.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kforge_cli.engine.train import TrainHook

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy")


class HostReads:
    """Totals by method name while `counting()` is active; `total` is their sum."""

    def __init__(self) -> None:
        self.by_name: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    @contextmanager
    def counting(self) -> Iterator[HostReads]:
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def counted(self_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.by_name[name] += 1
                return fn(self_, *args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)


class ReadsPerStep(TrainHook):
    """Records the running count at the end of every optimizer step (the hook itself reads nothing).

    Reads inside ``optimizer.step()`` are not counted: non-fused AdamW reads its per-parameter
    ``step`` counters, which torch keeps on the host for exactly that reason (no device sync).
    """

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self.at_end: dict[int, int] = {}

    def on_train_begin(self, session: Any) -> None:
        optimizer, reads = session.optimizer, self.reads
        original = optimizer.step

        def step_uncounted(*args: Any, **kwargs: Any) -> Any:
            before = reads.by_name.copy()
            try:
                return original(*args, **kwargs)
            finally:
                reads.by_name = before

        step_uncounted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # (the scheduler checks it)
        optimizer.step = step_uncounted

    def on_step_end(self, session: Any, info: Any) -> None:
        self.at_end[info.step] = self.reads.total

    def per_step(self) -> dict[int, int]:
        """Host reads of each step (from the end of the previous one; step 1 is left out)."""
        steps = sorted(self.at_end)
        return {s: self.at_end[s] - self.at_end[p] for p, s in itertools.pairwise(steps)}
