"""The GPU kit (bench/gpu) on CPU: a rehearsal of what the bare GPU machine must hold, and the
acceptance driver: valid cases in order of value, one deadline, failures as rows, few files."""

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
        "moe16b-shaped/4L bf16",
        "moe16b-shaped/4L bf16+compile",
        "flex vs dense SDPA, doc mask, 8k",
        "gpu tests (pytest -m gpu)",
        "8B-shaped/16L float8+compile",
    ]
    for case in bench.cases():
        if case.kind == "train":
            s = load_settings(case.profile, overrides=[*case.overrides, "--train.max_steps=12"]).settings
            assert s.train.device == "cuda" and s.train.mixed_precision == "bf16", case.name
            world = case.nproc or case.min_gpus  # "every GPU": checked at the smallest machine it runs on
            assert resolve_dims(s, world).world_size == world, case.name
            if "moe" in case.name:
                assert s.model.moe is not None and s.model.moe.grouped_mm and s.distributed.ep == 1
    one_gpu = [c for c in bench.cases() if c.min_gpus == 1]
    assert sum(c.cap_s for c in one_gpu[:4]) <= bench.BUDGET_S - 30  # the four most valuable fit even at their caps


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
    fake = [bench.Case("quick", "train", 100), bench.Case("slow", "train", 100), bench.Case("late", "train", 100)]
    monkeypatch.setattr(bench, "cases", lambda: fake)
    monkeypatch.setattr(bench, "MIN_START_S", 1.0)

    def command(case: object, gpus: int, row_file: Path, junit: Path, timeout_s: float) -> list[str]:
        cmd = commands[case.name]  # type: ignore[attr-defined]
        return [*cmd, str(row_file)] if case.name == "quick" else cmd  # type: ignore[attr-defined]

    monkeypatch.setattr(bench, "case_command", command)
    out = tmp_path / "out"
    t0 = time.time()
    rows = bench.run_all(t0 + 8.0, out, 1, "fake")
    assert time.time() - t0 < 20
    assert [r["status"] for r in rows][:1] == ["ok"] and rows[0]["tokens_per_s"] == 7.0
    assert rows[1]["status"].startswith("timeout after") and rows[2]["status"].startswith("skipped: out of time")
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
        '<testcase name="test_b"><failure message="bad"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = bench.summarise_junit(junit)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["compile_tp_parity"] == "skipped (needs 2 GPUs, found 1)" and got["status"] == "failed"
    assert got["failed_tests"] == ["test_b: bad"]


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
