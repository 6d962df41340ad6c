"""The GPU kit (bench/gpu) on CPU: a rehearsal of what the bare GPU machine must hold, and the
acceptance driver: valid cases in order of value, a schedule that starts a case only with its
minimum left (simulated durations), failures as rows, tests counted whatever happens, few files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kforge_cli.settings import load_settings, resolve_dims
from tests.conftest import REPO

KIT = REPO / "bench" / "gpu"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", KIT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("acceptance")


@pytest.fixture(scope="module")
def closure() -> ModuleType:
    return _load("closure")


# ---------------------------------------------------------------- the rehearsal


def test_the_gpu_run_imports_nothing_the_image_and_the_wheels_lack(closure: ModuleType) -> None:
    image, wheels = closure.read_list(KIT / "image-packages.txt"), closure.read_list(KIT / "wheels.txt")
    dists, conflicts = closure.needed(image, wheels)
    assert {"torch", "numpy", "pydantic", "pydantic-core", "typer", "torchao", "pytest"} <= dists
    assert closure.missing(image, wheels) == []
    assert conflicts == []  # every pin meets what the other wheels and kforge's pyproject require of it
    assert all(wheels.values()), "every wheel is pinned"
    assert set(wheels) <= dists, f"carried but not needed: {sorted(set(wheels) - dists)}"
    # The image's typing-extensions is too old for pydantic 2.14: the wheel is newer, and pinned so.
    assert "typing-extensions" in image and wheels["typing-extensions"] == "4.16.0"


@pytest.mark.parametrize(
    ("drop_from", "name"),
    [("image", "numpy"), ("image", "typer"), ("image", "pytest"), ("wheels", "torchao"), ("wheels", "pydantic-core")],
)
def test_the_rehearsal_fails_when_a_needed_package_is_dropped(closure: ModuleType, drop_from: str, name: str) -> None:
    image, wheels = closure.read_list(KIT / "image-packages.txt"), closure.read_list(KIT / "wheels.txt")
    (image if drop_from == "image" else wheels).pop(name)
    assert closure.missing(image, wheels) == [name]  # pydantic-core: needed through pydantic's requirements


def test_a_new_import_of_a_package_the_image_lacks_is_caught(closure: ModuleType, tmp_path: Path) -> None:
    """A copy of the source tree with one new module-level import in a test module: the rehearsal names it."""
    for part in ("src", "tests", "bench"):
        (tmp_path / part).symlink_to(REPO / part)
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    image, wheels = closure.read_list(KIT / "image-packages.txt"), closure.read_list(KIT / "wheels.txt")
    assert closure.missing(image, wheels, tmp_path) == []
    real = tmp_path / "tests"
    real.unlink()
    real.mkdir()
    for p in (REPO / "tests").iterdir():
        (real / p.name).symlink_to(p)
    (real / "test_new.py").write_text("import grimp\n\n\ndef test_x() -> None:\n    import wandb\n")
    assert closure.missing(image, wheels, tmp_path) == ["grimp"]  # collected: module level; wandb is optional


def test_optional_packages_are_ones_kforge_really_imports(closure: ModuleType) -> None:
    names = {closure.distribution_of(n) for n in closure.import_names()}
    assert set(closure.OPTIONAL) <= names  # an entry nothing imports any more is stale


def test_fetch_wheels_and_run_refuse_bad_arguments() -> None:
    for script in ("fetch-wheels", "run"):
        got = subprocess.run([KIT / script, "--nonsense"], capture_output=True, text=True, timeout=30)
        assert got.returncode == 2 and "usage: bench/gpu/" in got.stderr, (script, got.stderr)


@pytest.mark.skipif(sys.platform != "linux", reason="the GPU machine runs Linux")
def test_run_puts_src_on_the_path_and_prints_versions_without_installing_kforge(tmp_path: Path) -> None:
    """bench/gpu/run with no wheels: kforge is imported from src/ (nothing pip-installed), the versions
    are printed, and without CUDA the cases refuse to start (exit 2)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("would run the whole acceptance")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": "", "KFORGE_GPU_SITE": str(tmp_path / "site")}
    got = subprocess.run(
        [KIT / "run", str(tmp_path / "no-wheels"), "--out-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert got.returncode == 2, got.stdout + got.stderr
    assert f"kforge 0.1.0 {REPO / 'src' / 'kforge_cli' / '__init__.py'}" in got.stdout
    assert "torch " in got.stdout and "pydantic " in got.stdout
    assert "no wheels in" in got.stderr and "needs a CUDA GPU" in got.stderr


# ---------------------------------------------------------------- the acceptance cases


def test_every_training_case_is_a_valid_configuration_in_order_of_value(bench: ModuleType) -> None:
    names = [c.name for c in bench.cases()]
    assert len(names) == len(set(names))
    assert names[:6] == [
        "8B-shaped/16L bf16+compile",
        "8B-shaped/16L float8+compile",
        "1B async save (pinned), resume",
        "flex vs dense SDPA, doc mask, 8k",
        "moe16b-shaped/4L bf16+compile",
        "gpu tests (pytest -m gpu)",
    ]
    for case in bench.cases():
        assert 0 < case.min_s <= case.expected_s <= case.cap_s, case.name
        if case.kind in ("train", "save"):
            s = load_settings(case.profile, overrides=[*case.overrides, "--train.max_steps=12"]).settings
            assert s.train.device == "cuda" and s.train.mixed_precision == "bf16", case.name
            world = case.nproc or case.min_gpus  # "every GPU": checked at the smallest machine it runs on
            assert resolve_dims(s, world).world_size == world, case.name
            if "moe" in case.name:
                assert s.model.moe is not None and s.model.moe.grouped_mm and s.distributed.ep == 1
            if case.kind == "save":
                assert s.checkpoint.async_mode == "async_with_pinned_mem" and not s.train.compile_model
                assert not s.checkpoint.save_final  # one save of ~11.6 GB (the interval's)
                import inspect

                defaults = {k: v.default for k, v in inspect.signature(bench.save_case).parameters.items()}
                assert defaults["steps"] // defaults["interval"] == 1 < defaults["steps"] - defaults["interval"]
                assert 0.9e9 < s.model.param_count() < 1.2e9  # ~1B: 12 GB of weights + AdamW, the disk holds it
    small = load_settings(None, overrides=[*bench.SMALL_CUDA, "--train.max_steps=8"]).settings
    assert small.checkpoint.async_mode == "async_with_pinned_mem" and not small.train.compile_model


def test_the_plan_fits_the_budget_and_float8_is_not_left_to_the_end(bench: ModuleType) -> None:
    rows = bench.plan(500, gpus=1)
    by = {r["case"]: r for r in rows}
    one_gpu = [r for r in rows if r["start_s"] is not None]
    assert [r["case"] for r in rows if r["start_s"] is None] == [
        "1B FSDP all GPUs bf16+compile",
        "1B TP=2 bf16+compile",
    ]
    last = one_gpu[-1]
    assert last["start_s"] + last["expected_s"] <= 500  # everything scheduled fits at its expected time
    assert not any(r["verdict"].startswith(("dropped", "at risk")) for r in one_gpu)
    # The rows the run exists for start even if every earlier case runs to its cap.
    for name in ("8B-shaped/16L float8+compile", "1B async save (pinned), resume", "moe16b-shaped/4L bf16+compile"):
        assert by[name]["verdict"] == "runs even if every earlier case takes its cap", by[name]
    assert by["8B-shaped/16L float8+compile"]["worst_start_s"] <= 150
    assert by["moe16b-shaped/4L bf16+compile"]["cap_s"] > 130  # a cold compile of a MoE block
    # A shorter budget drops rows at the end rather than starving them.
    short = {r["case"]: r["verdict"] for r in bench.plan(300, gpus=1)}
    assert short["gpu tests (pytest -m gpu)"].startswith("dropped") and short[
        "8B-shaped/16L float8+compile"
    ].startswith("runs")
    assert "not run here" not in bench.format_plan(bench.plan(500, gpus=8), 500, 8)
    printed = subprocess.run(
        [KIT / "run", "--plan", "--budget-s", "500"], capture_output=True, text=True, timeout=60, env=_no_cuda_env()
    )
    assert printed.returncode == 0, printed.stderr
    assert "min s exp s cap s  start  worst" in printed.stdout and "expected end 495 s of 500 s" in printed.stdout


def _no_cuda_env() -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}


def test_a_slow_compile_skips_later_cases_rather_than_starting_them_without_their_minimum(
    bench: ModuleType, tmp_path: Path
) -> None:
    """Simulated durations on a simulated clock: the first case (a cold compile) runs far past its
    expected time into its cap; the next cases run while their minimum is left, then are skipped."""
    now = [1000.0]
    took = {c.name: c.expected_s for c in bench.cases()}
    took["8B-shaped/16L bf16+compile"] = 10_000  # a compile that never ends: stopped at its cap
    took["8B-shaped/16L float8+compile"] = 95  # over its expected 80
    took["moe16b-shaped/4L bf16+compile"] = 140  # a slow cold compile, inside its cap
    started: dict[str, float] = {}

    def run_case(case: object, timeout: float, log: Path, junit: Path) -> dict[str, object]:
        name = case.name  # type: ignore[attr-defined]
        started[name] = timeout
        spent = min(took[name], timeout)
        now[0] += spent
        return {"seconds": spent, "status": "ok" if took[name] <= timeout else f"timeout after {timeout:.0f} s"}

    deadline = now[0] + 500 - bench.SETUP_S
    rows = bench.run_all(deadline, tmp_path / "out", 1, "fake", run_case=run_case, clock=lambda: now[0])
    status = {r["case"]: r["status"] for r in rows}
    assert status["8B-shaped/16L bf16+compile"] == "timeout after 110 s"
    assert status["8B-shaped/16L float8+compile"] == "ok"
    # 480 - 110 - 95 - 50 - 35 = 190 s left: the MoE compile starts with its cap (160) and takes 140,
    # leaving the tests 50 s, under their minimum: skipped, not started to be killed
    assert started["moe16b-shaped/4L bf16+compile"] == 160 and status["moe16b-shaped/4L bf16+compile"] == "ok"
    assert status["gpu tests (pytest -m gpu)"] == "skipped: 50 s left, under its minimum of 60 s"
    assert all(t >= next(c.min_s for c in bench.cases() if c.name == n) for n, t in started.items())
    assert status["1B TP=2 bf16+compile"] == "skipped: needs 2 GPUs, found 1"
    assert now[0] <= deadline
    assert [r["expected_s"] for r in rows][:2] == [80, 80]
    assert "exp s" in bench.format_table(rows)


def test_the_8b_shaped_case_has_a_full_8b_flop_mix(bench: ModuleType) -> None:
    from kforge_cli.settings.training import ModelSettings

    case = bench.cases()[0]
    s = load_settings(None, overrides=[*case.overrides, "--train.max_steps=12"]).settings
    full = ModelSettings(**bench.LLAMA3_8B, vocab_size=bench.LLAMA3_8B_VOCAB, max_seq_len=2048)
    four = full.model_copy(update={"n_layers": 4})
    share = bench.head_flop_share(s.model, s.train.seq_len)
    assert share == pytest.approx(bench.head_flop_share(full, 2048), abs=1e-3)
    assert share == pytest.approx(0.0653, abs=5e-4)  # the number the README states
    assert bench.head_flop_share(four, 2048) > 0.35  # the old 4-block shape: over a third in the head
    assert (s.model.dim, s.model.n_heads, s.model.n_kv_heads, s.model.ffn_hidden_dim) == (4096, 32, 8, 14336)


def test_the_8b_shaped_case_fits_an_80_gb_gpu_with_the_same_flop_mix(bench: ModuleType) -> None:
    """kforge's planner: 16 blocks need ~87 GiB on one GPU (over an H100's 80 GB); 8 blocks with a
    quarter of the vocabulary keep the full 8B's head share of the FLOPs."""
    case = bench.cases()[1]
    assert bench.fitted_overrides(case, 139.8) == (case.overrides, None)  # an H200: as it is
    overrides, note = bench.fitted_overrides(case, 79.1)  # an H100
    s = load_settings(None, overrides=[*overrides, "--train.max_steps=12"]).settings
    assert (s.model.n_layers, s.model.vocab_size, s.train.float8) == (8, 32064, True)
    assert bench.head_flop_share(s.model, 2048) == pytest.approx(0.0653, abs=5e-4)
    assert note == "8 of 32 blocks, vocab 32064: 16 need ~87 GiB, this GPU has 79"
    assert 1.9e9 < s.model.param_count() < 2.1e9  # 16 bytes/param of states: 32 GB, not 64
    assert bench.fitted_overrides(bench.cases()[2], 79.1)[1] is None  # only the 8B-shaped cases change
    assert "[8 of 32 blocks" in bench.format_table([{"case": "8B", "status": "ok", "note": note}])


def test_failures_and_timeouts_are_rows(bench: ModuleType, tmp_path: Path) -> None:
    py = sys.executable
    hang = bench.run_subprocess([py, "-c", "import time; time.sleep(30)"], 0.5, tmp_path / "r.json", tmp_path / "a.log")
    assert hang["status"].startswith("timeout") and hang["seconds"] < 20
    boom = bench.run_subprocess([py, "-c", "raise SystemExit('boom')"], 20, tmp_path / "r.json", tmp_path / "b.log")
    assert boom["status"] == "failed (exit 1)" and "boom" in boom["log_tail"]
    write = f"open({str(tmp_path / 'r.json')!r}, 'w').write('{{\"tokens_per_s\": 5.0}}')"
    ok = bench.run_subprocess([py, "-c", write], 20, tmp_path / "r.json", tmp_path / "c.log")
    assert ok["status"] == "ok" and ok["tokens_per_s"] == 5.0


def test_one_deadline_for_all_cases_and_at_most_three_result_files(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A case over the deadline is cut there (its cap notwithstanding); later cases are rows saying so."""
    import time

    py = sys.executable
    commands = {
        "quick": [py, "-c", "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'tokens_per_s': 7.0}))"],
        "slow": [py, "-c", "import time; print('working'); time.sleep(60)"],
    }
    fake = [bench.Case(n, "train", 100, min_s=1, expected_s=1) for n in ("quick", "slow", "late")]
    monkeypatch.setattr(bench, "cases", lambda: fake)

    def command(case: object, gpus: int, row_file: Path, junit: Path, timeout_s: float) -> list[str]:
        cmd = commands[case.name]  # type: ignore[attr-defined]
        return [*cmd, str(row_file)] if case.name == "quick" else cmd  # type: ignore[attr-defined]

    monkeypatch.setattr(bench, "case_command", command)
    out = tmp_path / "out"
    t0 = time.time()
    rows = bench.run_all(t0 + 8.0, out, 1, "fake")
    assert time.time() - t0 < 20
    assert [r["status"] for r in rows][:1] == ["ok"] and rows[0]["tokens_per_s"] == 7.0
    assert rows[1]["status"].startswith("timeout after") and rows[2]["status"].startswith("skipped: 0 s left")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["logs.txt", "results.json"] and len(files) <= 8
    assert "===== slow: timeout" in (out / "logs.txt").read_text() and "working" in (out / "logs.txt").read_text()
    assert [r["case"] for r in json.loads((out / "results.json").read_text())["rows"]] == ["quick", "slow", "late"]


def test_junit_summary_reads_counts_and_the_parity_test(bench: ModuleType, tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(
        "<testsuites><testsuite>"
        '<testcase name="test_a"/>'
        '<testcase name="test_compile_with_tensor_parallel_matches_eager_on_cuda">'
        '<skipped message="needs 2 GPUs, found 1"/></testcase>'
        '<testcase name="test_fsdp"><skipped message="needs 2 GPUs, found 1"/></testcase>'
        '<testcase name="test_c"><skipped message="no torchao"/></testcase>'
        '<testcase name="test_b"><failure message="bad"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = bench.summarise_junit(junit)
    assert (got["passed"], got["failed"], got["skipped"], got["not_run_here"]) == (1, 1, 1, 2)
    assert got["compile_tp_parity"] == "not run here (needs 2 GPUs)" and got["status"] == "failed"
    assert got["failed_tests"] == ["test_b: bad"]
    assert "1 passed, 1 failed, 1 skipped, 2 not run here (needs 2 GPUs)" in bench.format_table([{"case": "t", **got}])


# pytest -v as it streams: the run was killed in the fourth test, before any report was written.
VERBOSE_LOG = """============================= test session starts ==============================
collecting ... collected 1210 items / 1200 deselected / 10 selected

tests/unit/test_attention.py::test_flex_on_cuda PASSED                   [ 10%]
tests/unit/test_observe.py::test_peak_memory_on_cuda FAILED              [ 20%]
tests/distributed/test_gpu.py::test_fsdp_float8_all_gather_on_nccl SKIPPED (needs 2 GPUs, found 1) [ 30%]
tests/distributed/test_gpu.py::test_compile_with_tensor_parallel_matches_eager_on_cuda SKIPPED (needs 2 GPUs, found 1) [ 40%]
tests/distributed/test_gpu.py::test_float8_with_compile SKIPPED (torchao not installed) [ 50%]
tests/distributed/test_gpu.py::test_compiled_moe_keeps_grouped_gemm_in_one_graph_on_one_gpu
"""


def test_tests_row_counts_come_from_the_log_when_no_report_was_written(bench: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "t.log"
    log.write_text(VERBOSE_LOG)
    row = bench.tests_row({"status": "timeout after 150 s", "seconds": 150.0}, tmp_path / "none.xml", log)
    assert (row["passed"], row["failed"], row["skipped"], row["not_run_here"], row["not_reached"]) == (1, 1, 1, 2, 5)
    assert row["failed_tests"] == ["test_peak_memory_on_cuda: "]
    assert row["status"] == "timeout after 150 s, counts of the tests that ran"
    assert row["compile_tp_parity"] == "not run here (needs 2 GPUs)"
    table = bench.format_table([{"case": "gpu tests", **row}])
    assert (
        "1 passed, 1 failed, 1 skipped, 2 not run here (needs 2 GPUs), 5 not reached (counts from the -v log)" in table
    )


def test_tests_command_stops_in_time_and_runs_cheap_tests_first(bench: ModuleType, tmp_path: Path) -> None:
    cmd = bench.tests_command(tmp_path / "j.xml", 150, session_timeout=True)
    assert "-v" in cmd and "--timeout=120" in cmd and "--session-timeout=125" in cmd
    assert cmd[-1] == "tests/distributed" and cmd.index("tests/unit") < cmd.index("tests/distributed")
    short = bench.tests_command(tmp_path / "j.xml", 60, session_timeout=False)
    assert "--timeout=50" in short and not any(a.startswith("--session-timeout") for a in short)
    assert bench.session_timeout_supported()  # pytest-timeout 2.4 here; the image's is read the same way


def test_a_real_pytest_cut_by_its_session_timeout_still_reports(bench: ModuleType, tmp_path: Path) -> None:
    """pytest with the row's flags on three slow tests: the session time ends after the first, the report
    is written, and the row's counts say what ran."""
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n"
        "def test_a(): time.sleep(1.5)\n"
        "def test_b(): pytest.skip('needs 2 GPUs, found 1')\n"
        "def test_c(): time.sleep(1.5)\n"
    )
    junit, log = tmp_path / "j.xml", tmp_path / "p.log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--session-timeout=1", f"--junitxml={junit}"]
    result = bench.run_subprocess([*cmd, str(tmp_path / "test_slow.py")], 60, None, log, interrupt_first=True)
    row = bench.tests_row(result, junit, log)
    assert (row["passed"], row["not_run_here"]) == (1, 0) and row["status"].startswith("ok (session time up"), row


def test_table_and_json_cover_every_row_kind(bench: ModuleType, tmp_path: Path) -> None:
    raw = {"backends": {"flex": {"tokens_per_s": 300.0}, "sdpa_dense": {"tokens_per_s": 100.0}}, "flex_over_dense": 3}
    rows = [
        {"case": "8B", "status": "ok", "tokens_per_s": 12345.6, "mfu": 0.41, "peak_mem_gib": 20.5, "seconds": 40},
        {"case": "1B TP=2", "status": "skipped: needs 2 GPUs, found 1"},
        {"case": "8B float8", "status": "timeout after 150 s", "seconds": 150.0, "log_tail": "..."},
        {"case": "tests", "status": "ok", "passed": 5, "failed": 0, "skipped": 2, "compile_tp_parity": "passed"},
        {"case": "flex", **bench.attention_row(raw)},
    ]
    rows[0]["head_flop_share"] = 0.0653
    table = bench.format_table(rows)
    assert "12,346" in table and "41.0%" in table and "20.5" in table and "head 6.5% of FLOPs" in table
    assert "needs 2 GPUs" in table and "timeout after 150 s" in table
    assert "5 passed, 0 failed, 2 skipped; compile+TP parity vs eager: passed" in table
    assert "flex/dense = 3.00x" in table
    printed = json.loads(bench.json_table(rows))
    assert [r["case"] for r in printed] == [r["case"] for r in rows] and "log_tail" not in printed[2]
    out = tmp_path / "results" / "gpu.json"
    bench.write_results(rows, out, {"device": "cpu"})
    assert json.loads(out.read_text())["rows"][0]["mfu"] == 0.41


def test_versions_do_not_report_the_metrics_backends_the_cases_never_use(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image has no mlflow-skinny (kforge's pyproject requires it for metrics.backends = ['mlflow']):
    no alarming "NOT MET" line for it; a real gap is still reported."""
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        if name in ("mlflow-skinny", "tomli-w"):
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    unmet = bench.versions()[1]
    assert not any("mlflow" in u for u in unmet) and any(u.startswith("tomli-w") for u in unmet), unmet


def test_the_async_save_case_runs_through_on_cpu(bench: ModuleType, tmp_path: Path) -> None:
    """The save case's code at a tiny size on CPU (async without pinned memory): two saves measured
    against dd, and a SIGTERM-stopped run resumed equal to the uninterrupted one."""
    from tests.helpers import tiny

    small = [*tiny.model(32, 2, 4, 2, max_seq_len=32), "--train.seq_len=16", *tiny.CPU_FP32, *tiny.QUIET]
    small += ["--scheduler.warmup_steps=2", "--checkpoint.async_mode=async"]
    case = bench.Case("save", "save", 60, [*small, "--checkpoint.save_final=false"])
    row = bench.save_case(case, steps=4, interval=3, small=small, small_steps=4)
    assert row["status"] == "ok" and row["resume_equal"] and row["resume_steps"] == [3, 4], row
    assert row["resume_max_rel_diff"] == 0.0  # bit for bit on CPU
    assert row["saves"] == 1 and row["save_bytes"] > 0 and row["dd_mb_per_s"] > 0 and row["save_over_dd"] > 0
    assert row["blocked_s"] >= 0 and row["blocked_over_step"] == pytest.approx(row["blocked_s"] / row["step_s"])
    assert "save" in bench.format_table([{"case": "save", **row}])
