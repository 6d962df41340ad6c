"""Straggler report: which rank is slow, from one small all-gather per logging interval.

A rank's wall-clock step time says nothing here: every rank waits for the slowest one
inside the step's collectives, so all step times come out equal. What differs is the
work a rank does alone, and the report measures that part of each step: loading its
batch (host time in the data loader) and the optimizer update (host time on the CPU;
CUDA events on a GPU, read only once they have completed, so no step waits for them).
A throttled or failing GPU, a slow host or a slow data worker shows up there; waiting
for other ranks does not.

Every step adds two timestamps (or two event records) and nothing else. On a logging
step each rank reduces its window to the median over its steps (one descheduled step
does not make a straggler), and one all-gather shares [median, local parameter count].
Ranks are compared only with ranks holding as many parameters (under pipeline
parallelism the stages differ by design): ``straggler/max_over_median`` is the slowest
rank's time over the (lower) median rank's, ``straggler/slowest_rank`` names it, and
when the same rank stays above ``resilience.straggler_ratio`` for
``resilience.straggler_windows`` intervals in a row, a warning names it and its host.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger("kforge")


class StragglerMonitor:
    """One rank's side of the report; `report` is a collective (call it on every rank, same steps)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        ratio: float,
        windows: int,
        local_params: int,
        exclude_ratio: float = 0.0,
        exclude_windows: int = 0,
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.ratio, self.windows, self.local_params = ratio, windows, local_params
        self.exclude_ratio, self.exclude_windows = exclude_ratio, exclude_windows  # 0 windows: never exclude
        self.exclude_streak = 0
        self.exclude_rank: int | None = None
        self.exclusion: dict[str, object] | None = None  # set once: the straggler to leave behind
        self.cuda = device.type == "cuda"
        self._samples: list[float] = []  # seconds of local work per step, this window
        self._pending: list[
            tuple[float, torch.cuda.Event, torch.cuda.Event]
        ] = []  # CUDA: (data seconds, start event, end event)
        self._spare: list[torch.cuda.Event] = []
        self.streak = 0
        self.streak_rank: int | None = None
        self.hosts: list[str] | None = None
        self.nodes: list[str | None] | None = None  # SLURM node names (SLURMD_NODENAME), None outside SLURM

    # ---- every step -------------------------------------------------------------------------

    def begin_update(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        start = self._event()
        start.record()
        return start

    def end_update(self, token: float | torch.cuda.Event, data_s: float) -> None:
        """``token``: what ``begin_update`` returned (a clock reading on CPU, a recorded event on CUDA)."""
        if not isinstance(token, torch.cuda.Event):
            self._samples.append(data_s + time.perf_counter() - token)
            return
        end = self._event()
        end.record()
        self._pending.append((data_s, token, end))

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def reset(self) -> None:
        """Drop the current window (after a rewind)."""
        self._samples.clear()
        self._spare += [e for _, start, end in self._pending for e in (start, end)]
        self._pending.clear()

    # ---- logging steps ----------------------------------------------------------------------

    def _take(self) -> float:
        """This window's median local work per step (seconds); CUDA events not yet done wait for the next window."""
        still: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        for data_s, start, end in self._pending:
            if end.query():
                self._samples.append(data_s + start.elapsed_time(end) / 1000.0)
                self._spare += [start, end]
            else:
                still.append((data_s, start, end))
        self._pending = still
        value = statistics.median(self._samples) if self._samples else 0.0
        self._samples.clear()
        return value

    def report(self, step: int) -> dict[str, float | int | str]:
        """Share this window's numbers (one all-gather) and return the metrics record's straggler fields."""
        if self.hosts is None:
            where: list[object] = [None] * self.world_size
            dist.all_gather_object(where, (socket.gethostname(), os.environ.get("SLURMD_NODENAME") or None))
            pairs = [w if isinstance(w, tuple) and len(w) == 2 else (w, None) for w in where]
            self.hosts = [str(h) for h, _ in pairs]
            self.nodes = [str(n) if n else None for _, n in pairs]
        mine = torch.tensor([self._take(), float(self.local_params)], dtype=torch.float64, device=self.device)
        everyone = torch.empty(self.world_size * 2, dtype=torch.float64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it
        gather(everyone, mine)
        rows = everyone.view(self.world_size, 2).tolist()
        found = worst_group(rows)
        if found is None:
            return {}
        ratio, slowest, median = found
        self._track(step, ratio, slowest, rows[slowest][0], median)
        self._track_exclusion(step, ratio, slowest)
        fields: dict[str, float | int | str] = {
            "straggler/max_over_median": ratio,
            "straggler/slowest_rank": slowest,
            "straggler/slowest_host": self.hosts[slowest],
            "straggler/slowest_ms": rows[slowest][0] * 1000.0,
            "straggler/median_ms": median * 1000.0,
        }
        node = self.nodes[slowest] if self.nodes else None
        if node:
            fields["straggler/slowest_node"] = node
        return fields

    def _track_exclusion(self, step: int, ratio: float, slowest: int) -> None:
        if self.exclude_windows <= 0 or self.exclusion is not None:
            return
        if ratio > self.exclude_ratio:
            self.exclude_streak = self.exclude_streak + 1 if slowest == self.exclude_rank else 1
            self.exclude_rank = slowest
        else:
            self.exclude_streak, self.exclude_rank = 0, None
        if self.exclude_streak < self.exclude_windows:
            return
        node = self.nodes[slowest] if self.nodes else None
        if node is None:
            if self.rank == 0 and self.exclude_streak == self.exclude_windows:
                log.warning(
                    "straggler: rank %d stays above resilience.exclude_straggler_ratio = %g, but it runs outside "
                    "SLURM (no SLURMD_NODENAME): there is no node to exclude; training goes on",
                    slowest,
                    self.exclude_ratio,
                )
            return
        self.exclusion = {
            "step": step,
            "rank": slowest,
            "host": self.hosts[slowest] if self.hosts else None,
            "node": node,
            "ratio": round(ratio, 3),
            "windows": self.exclude_streak,
            "threshold": self.exclude_ratio,
        }

    def _track(self, step: int, ratio: float, slowest: int, slow_s: float, median_s: float) -> None:
        if ratio > self.ratio:
            self.streak = self.streak + 1 if slowest == self.streak_rank else 1
            self.streak_rank = slowest
        else:
            self.streak, self.streak_rank = 0, None
        if self.streak >= self.windows and (self.streak - self.windows) % self.windows == 0 and self.rank == 0:
            host = self.hosts[slowest] if self.hosts else "?"
            node = self.nodes[slowest] if self.nodes else None
            if node:
                host += f", SLURM node {node}"
            log.warning(
                "straggler: rank %d (host %s) has done its local step work (data loading + optimizer update) "
                "%.2fx slower than the median rank (%.1f ms vs %.1f ms per step) for %d logging intervals in a row, "
                "up to step %d (resilience.straggler_ratio = %g); the whole job runs at its pace",
                slowest,
                host,
                ratio,
                slow_s * 1000.0,
                median_s * 1000.0,
                self.streak,
                step,
                self.ratio,
            )


def worst_group(rows: list[list[float]]) -> tuple[float, int, float] | None:
    """(max over lower median, the slowest rank, the median) over ranks holding equal parameter counts;
    the group where the ratio is largest. None when no two ranks are comparable."""
    groups: dict[float, list[int]] = {}
    for rank, (_, params) in enumerate(rows):
        groups.setdefault(params, []).append(rank)
    best: tuple[float, int, float] | None = None
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        times = [rows[r][0] for r in ranks]
        median = statistics.median_low(times)
        slowest = max(ranks, key=lambda r: rows[r][0])
        ratio = rows[slowest][0] / median if median > 0 else 1.0
        if best is None or ratio > best[0]:
            best = (ratio, slowest, median)
    return best


def local_parameter_count(model: nn.Module) -> int:
    """Parameters this rank holds (its shards of DTensors)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
