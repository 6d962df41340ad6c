"""Helpers of the parallel-parity tests: one multi-rank launch runs many training cases
(``tests.helpers.ranks``); references are single-process runs of the same settings in the test process."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from tests.helpers import tiny
from tests.helpers.launch import run_ranks
from tests.helpers.ranks import train, train_cases

# Ten steps of the parity model (tiny.PARITY_MODEL), one thread per process, nothing saved.
TINY = [
    *tiny.PARITY_MODEL,
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--train.max_steps=10",
    *tiny.CPU_FP32,
    *tiny.QUIET,
    "--checkpoint.save_final=false",
    "--checkpoint.interval=0",
    "--scheduler.warmup_steps=2",
]


def launch(nproc: int, cases: dict[str, list[str]], out_dir: Path, timeout: float = 600) -> dict[str, list[dict]]:
    """Train every case (TINY + its overrides) in one ``nproc``-rank launch; {case: [result of rank r]}."""
    return run_ranks(nproc, train_cases(cases, base=TINY), out_dir, timeout)


@cache
def reference(overrides: tuple[str, ...]) -> dict[str, Any]:
    """A single-process run of TINY + overrides (cached: several cases share a reference)."""
    out = Path(tempfile.mkdtemp(prefix="kforge-ref-"))
    return train("ref", [*TINY, *overrides], out)


def assert_close_losses(got: list[float], want: list[float], rel: float, what: str) -> None:
    assert len(got) == len(want) == 10, (what, len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(g - w) <= rel * abs(w), f"{what}: step {step} loss {g!r} vs reference {w!r} (rel tol {rel})"


def completed(results: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert r["status"] == "completed", f"{name} rank {rank}: {r.get('error', r['status'])}"
    return results
