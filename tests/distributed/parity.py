"""Helpers of the parallel-parity tests: one torchrun launch runs many cases (driver.py);
references are single-process runs of the same settings in the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from tests.distributed.driver import run_case
from tests.helpers import tiny

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

# Stable across runs, so a torch.compile after the first is a cache hit.
INDUCTOR_CACHE = Path(tempfile.gettempdir()) / "kforge-test-inductor-cache"


def launch(nproc: int, cases: dict[str, list[str]], out_dir: Path, timeout: float = 600) -> dict[str, list[dict]]:
    """Run every case in one ``torch.distributed.run`` launch; {case: [result of rank r]}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "cases.json"
    spec.write_text(json.dumps([{"name": n, "overrides": [*TINY, *o]} for n, o in cases.items()]))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "tests" / "distributed" / "driver.py"),
        str(spec),
        str(out_dir),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results: dict[str, list[dict]] = {}
    for name in cases:
        files = [out_dir / f"{name}.rank{r}.json" for r in range(nproc)]
        if not all(f.is_file() for f in files):
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise AssertionError(f"case {name} left no result on every rank (exit {proc.returncode}):\n{tail}")
        results[name] = [json.loads(f.read_text()) for f in files]
    return results


@cache
def reference(overrides: tuple[str, ...]) -> dict[str, Any]:
    """A single-process run of TINY + overrides (cached: several cases share a reference)."""
    out = Path(tempfile.mkdtemp(prefix="kforge-ref-"))
    return run_case("ref", [*TINY, *overrides], out)


def assert_close_losses(got: list[float], want: list[float], rel: float, what: str) -> None:
    assert len(got) == len(want) == 10, (what, len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(g - w) <= rel * abs(w), f"{what}: step {step} loss {g!r} vs reference {w!r} (rel tol {rel})"


def completed(results: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert r["status"] == "completed", f"{name} rank {rank}: {r.get('error', r['status'])}"
    return results
