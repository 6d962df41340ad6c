"""bench/gpu_acceptance.py's driver on CPU: its cases are valid settings, a failing or hanging
case becomes a row (not an abort), and the table/JSON writer handles every kind of row."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from kforge_cli.settings import load_settings, resolve_dims
from tests.conftest import REPO


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance", REPO / "bench" / "gpu_acceptance.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_every_training_case_is_a_valid_configuration() -> None:
    bench = _bench()
    names = [c.name for c in bench.cases()]
    assert len(names) == len(set(names))
    for case in bench.cases():
        if case.kind == "train":
            s = load_settings(case.profile, overrides=[*case.overrides, "--train.max_steps=12"]).settings
            assert s.train.device == "cuda", case.name
            world = case.nproc or case.min_gpus  # "every GPU": checked at the smallest machine it runs on
            assert resolve_dims(s, world).world_size == world, case.name


def test_failures_and_timeouts_are_rows(tmp_path: Path) -> None:
    bench = _bench()
    py = sys.executable
    hang = bench.run_subprocess([py, "-c", "import time; time.sleep(30)"], 0.5, tmp_path / "r.json", tmp_path / "a.log")
    assert hang["status"] == "timeout after 0 s" or hang["status"].startswith("timeout")
    boom = bench.run_subprocess([py, "-c", "raise SystemExit('boom')"], 20, tmp_path / "r.json", tmp_path / "b.log")
    assert boom["status"] == "failed (exit 1)" and "boom" in boom["log_tail"]
    write = f"open({str(tmp_path / 'r.json')!r}, 'w').write('{{\"tokens_per_s\": 5.0}}')"
    ok = bench.run_subprocess([py, "-c", write], 20, tmp_path / "r.json", tmp_path / "c.log")
    assert ok["status"] == "ok" and ok["tokens_per_s"] == 5.0


def test_junit_summary_reads_counts_and_the_parity_test(tmp_path: Path) -> None:
    bench = _bench()
    junit = tmp_path / "j.xml"
    junit.write_text(
        "<testsuites><testsuite>"
        '<testcase name="test_a"/>'
        '<testcase name="test_compile_with_tensor_parallel_matches_eager_on_cuda">'
        '<skipped message="needs 2 GPUs, found 1"/></testcase>'
        '<testcase name="test_b"><failure message="bad"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = bench.summarise_junit(junit)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["compile_tp_parity"] == "skipped (needs 2 GPUs, found 1)" and got["status"] == "failed"


def test_table_and_json_cover_every_row_kind(tmp_path: Path) -> None:
    bench = _bench()
    raw = {"backends": {"flex": {"tokens_per_s": 300.0}, "sdpa_dense": {"tokens_per_s": 100.0}}, "flex_over_dense": 3}
    rows = [
        {"case": "1B bf16", "status": "ok", "tokens_per_s": 12345.6, "mfu": 0.41, "peak_mem_gib": 20.5, "seconds": 40},
        {"case": "1B TP=2", "status": "skipped: needs 2 GPUs, found 1"},
        {"case": "8B float8", "status": "timeout after 150 s", "seconds": 150.0, "log_tail": "..."},
        {"case": "tests", "status": "ok", "passed": 5, "failed": 0, "skipped": 2, "compile_tp_parity": "passed"},
        {"case": "flex", **bench.attention_row(raw)},
    ]
    table = bench.format_table(rows)
    assert "12,346" in table and "41.0%" in table and "20.5" in table
    assert "needs 2 GPUs" in table and "timeout after 150 s" in table
    assert "5 passed, 0 failed, 2 skipped; compile+TP parity vs eager: passed" in table
    assert "flex/dense = 3.00x" in table
    out = tmp_path / "results" / "gpu.json"
    bench.write_results(rows, out, {"device": "cpu"})
    assert json.loads(out.read_text())["rows"][0]["mfu"] == 0.41
