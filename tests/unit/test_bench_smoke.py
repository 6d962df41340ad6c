"""Every benchmark under bench/ still runs: `--help` for each, and its smallest size (`--smoke`)
where that takes under about 5 s (issue 39: benchmarks rotted while the code moved under them).

Each script runs in this process as ``__main__`` (runpy), so torch and kforge are imported
once for all of them. Benchmarks whose smallest run is a whole training job or a multi-process
launch (train_overhead, train_contention, moe_balance, resilience_overhead, muon_distributed:
each has a ``--smoke`` mode for a person; cp_memory, plan_*, hostile_*, single_gpu_throughput)
get only ``--help`` here;
bench/attention_speed.py's smoke mode has its own test, bench/gpu/ the GPU kit's.
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

BENCH = REPO / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
# script -> a line its smoke run prints
SMOKE = {
    "checkpoint_io.py": "async staging buffer:",
    "cli_startup.py": "ratio kforge/bare",
    "generate_speed.py": "speed-up of the KV cache",
    "prepare_data_bench.py": "bpe, 1 worker",
    "runs_speed.py": "kforge runs, 20 runs",
}


def _run_as_main(script: str, *argv: str) -> int:
    """Run bench/`script` as ``python bench/script argv...`` would, here; its exit code."""
    saved_argv, saved_path, threads = sys.argv, list(sys.path), torch.get_num_threads()
    sys.argv = [str(BENCH / script), *argv]
    sys.path.insert(0, str(BENCH))
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
    return 0


def test_every_bench_script_is_listed_in_the_benchmarks_doc() -> None:
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    missing = [s for s in SCRIPTS if s != "bare_typer_app.py" and f"`{s}`" not in doc]
    assert not missing, missing


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_answers_help(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_as_main(script, "--help") == 0
    out = capsys.readouterr().out
    assert "usage:" in out.lower(), out[-2000:]
    if script in SMOKE:
        assert "--smoke" in out, out


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_bench_smoke_run(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = BENCH / "results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("*")} if results.is_dir() else {}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert _run_as_main(script, "--smoke") == 0
    out = capsys.readouterr().out
    assert SMOKE[script] in out, out[-2000:]
    after = {p: p.stat().st_mtime_ns for p in results.glob("*")} if results.is_dir() else {}
    assert after == before, "a smoke run must leave bench/results/ alone"
