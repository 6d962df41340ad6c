"""`validate-config`, `--sbatch` and the settings loader against the data on disk (no torch, no training)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import run_kforge

    root = tmp_path_factory.mktemp("bytedata")
    text = root / "a.txt"
    text.write_text("".join(f"line {i} of a small corpus.\n" for i in range(400)))
    r = run_kforge("prepare-data", str(text), "--out", str(root / "prepared"), "--quiet", "--workers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "prepared"


def test_missing_data_path_is_refused_naming_the_field(kforge, tmp_path: Path) -> None:
    r = kforge("validate-config", f"--data.path={tmp_path / 'nope'}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "data.path" in r.stderr and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_vocab_smaller_than_the_datas_tokenizer_is_refused(kforge, byte_data: Path) -> None:
    r = kforge("validate-config", f"--data.path={byte_data}", "--model.vocab_size=200")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model.vocab_size" in r.stderr and "257" in r.stderr and "--model.vocab_size=320" in r.stderr
    ok = kforge("validate-config", f"--data.path={byte_data}")
    assert ok.returncode == 0, ok.stderr


def test_gpu_profiles_need_real_data(kforge, byte_data: Path) -> None:
    r = kforge("validate-config", "-p", "h100x64")
    assert r.returncode == 2 and "data.path" in r.stderr and "demo corpus" in r.stderr, r.stderr
    ok = kforge("validate-config", "-p", "h100x64", f"--data.path={byte_data}")
    assert ok.returncode == 0 and "world size 64" in ok.stdout, ok.stderr


def test_sbatch_checks_data_before_writing_the_script(kforge, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = kforge("train", "--sbatch", "--run-dir", str(run), f"--data.path={tmp_path / 'nope'}")
    assert r.returncode == 2 and "data.path" in r.stderr, r.stderr
    assert not (run / "job.sbatch").exists()


def test_relative_paths_are_stored_absolute(kforge, byte_data: Path, tmp_path: Path) -> None:
    (tmp_path / "mine").symlink_to(byte_data)
    r = kforge("validate-config", "--data.path=mine", "--format", "toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f'path = "{(tmp_path / "mine").resolve()}"' in r.stdout


def test_warmup_longer_than_max_steps_is_a_warning(kforge) -> None:
    r = kforge("validate-config", "--train.max_steps=10")
    assert r.returncode == 0, r.stderr
    assert "warning: scheduler.warmup_steps" in r.stderr and "train.max_steps (10)" in r.stderr


def test_unknown_keys_are_searched_across_sections_and_aliases(kforge, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[optimizer]\nwarmup_steps = 5\n")
    r = kforge("validate-config", "--config", str(cfg), "--optimizer.learning_rate=1e-3")
    assert r.returncode == 2
    assert "optimizer.warmup_steps: unknown key" in r.stderr and "did you mean scheduler.warmup_steps" in r.stderr
    assert "did you mean optimizer.lr" in r.stderr, r.stderr
    e = kforge("validate-config", "--explain", "lr")
    assert e.returncode == 2 and "did you mean optimizer.lr" in e.stderr, e.stderr


def test_field_errors_and_rules_are_reported_in_one_pass(kforge, tmp_path: Path) -> None:
    r = kforge("validate-config", "--model.dim=abc", "--train.seq_len=100000", f"--data.path={tmp_path / 'nope'}")
    assert r.returncode == 2
    assert "(3 problems)" in r.stderr, r.stderr
    for key in ("model.dim", "train.seq_len", "data.path"):
        assert f"- {key}:" in r.stderr, (key, r.stderr)


def test_vlm_parameter_count_includes_the_vision_parts(kforge) -> None:
    r = kforge("validate-config", "-p", "vlm-mot-debug")
    assert r.returncode == 0, r.stderr
    assert "1.8M parameters" in r.stdout and "vision parts add" in r.stdout, r.stdout
    assert "vision encoder 0.11M" in r.stdout and "mot layers 0.79M" in r.stdout
