"""`kforge train` for real, in a subprocess."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from kforge_cli.engine.observe import read_metrics as observe_read_metrics
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def read_metrics(run_dir: Path) -> list[dict]:
    return observe_read_metrics(run_dir / "metrics.jsonl")


def test_default_train_with_no_arguments_learns(kforge, tmp_path: Path) -> None:
    r = kforge("train", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("cpu-debug-")
    records = read_metrics(runs[0])
    steps = [m for m in records if "loss" in m]
    evals = [m for m in records if "eval_loss" in m]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == 300
    for key in ("loss", "lr", "grad_norm", "tokens_seen", "tokens_per_sec", "step_time_s", "time"):
        assert key in steps[-1], key
    assert steps[-1]["tokens_seen"] == 300 * 16 * 128
    first, last = steps[0]["loss"], steps[-1]["loss"]
    assert last < 0.6 * first, (first, last)
    assert evals and evals[-1]["eval_loss"] < 0.6 * first
    assert (runs[0] / "config.toml").is_file() and (runs[0] / "logs" / "rank_0.log").is_file()


def test_nan_abort_exits_non_zero(kforge, tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "KFORGE_TEST_NAN_STEPS": "2"}
    r = kforge(
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--train.max_steps=5",
        "--scheduler.warmup_steps=1",
        "--eval.interval=0",
        '--train.hooks=["tests.helpers.nan_hooks:InjectNaN"]',
        "--resilience.nan_policy=abort",
        "--resilience.nan_max_consecutive=1",
        env=env,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "nan_policy = 'abort'" in r.stderr and "Traceback" not in r.stderr


def test_bad_hook_path_is_a_clear_error(kforge, tmp_path: Path) -> None:
    r = kforge("train", "--run-dir", str(tmp_path / "run"), '--train.hooks=["no_such_pkg.mod:Hook"]')
    assert r.returncode == 2 and "no_such_pkg" in r.stderr and "Traceback" not in r.stderr


def test_prepare_data_then_train_reports_eval_loss(kforge, tmp_path: Path) -> None:
    from tests.e2e.test_prepare_data import stories_file

    text = stories_file(tmp_path / "stories.txt")  # the built-in corpus's stories: no file outside the repo
    data = tmp_path / "stories"
    p = kforge("prepare-data", str(text), "--tokenizer", "byte", "--out", str(data), "--quiet")
    assert p.returncode == 0, p.stderr[-2000:]
    run = tmp_path / "run"
    r = kforge(
        "train",
        "--run-dir",
        str(run),
        f"--data.path={data}",
        "--train.max_steps=30",
        "--eval.interval=15",
        "--eval.steps=2",
        "--checkpoint.interval=0",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    evals = [m for m in read_metrics(run) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [15, 30]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < 6.0


def test_mixture_logs_tokens_per_dataset(kforge, tmp_path: Path) -> None:
    for name, word in (("a", "alpha"), ("b", "beta")):
        src = tmp_path / f"{name}.txt"
        src.write_text("\n".join(f"{word} {i} {word}" for i in range(3000)))
        assert kforge("prepare-data", str(src), "--out", str(tmp_path / name), "--quiet").returncode == 0
    run = tmp_path / "run"
    datasets = f'[{{name="a", path="{tmp_path / "a"}", weight=3}}, {{name="b", path="{tmp_path / "b"}", weight=1}}]'
    r = kforge(
        "train",
        "--run-dir",
        str(run),
        f"--data.datasets={datasets}",
        "--train.max_steps=20",
        "--eval.interval=0",
        "--checkpoint.interval=0",
        "--metrics.log_interval=20",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    last = [m for m in read_metrics(run) if "loss" in m][-1]
    a, b = last["tokens/a"], last["tokens/b"]
    assert a + b == last["tokens_seen"]
    assert abs(a / (a + b) - 0.75) < 0.02
    assert 0 < last["loss/a"] < 6 and 0 < last["loss/b"] < 6 and last["loss/a"] != last["loss/b"]
    # the total is the token-weighted mean of the per-dataset losses
    assert min(last["loss/a"], last["loss/b"]) <= last["loss"] <= max(last["loss/a"], last["loss/b"])


def test_profile_given_as_a_path_names_the_run_dir_like_sbatch(kforge, tmp_path: Path) -> None:
    """`--profile dir/my.toml`: training and --sbatch both pick runs/my-<timestamp> under the cwd."""
    profile = tmp_path / "profiles_elsewhere" / "my.toml"
    profile.parent.mkdir()
    profile.write_text(
        'extends = "cpu-debug"\n[model]\ndim = 32\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\n'
        "[train]\nmax_steps = 1\nbatch_size = 2\nseq_len = 32\n[eval]\ninterval = 0\n"
        "[checkpoint]\nsave_final = false\n[scheduler]\nwarmup_steps = 1\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    trained = kforge("train", "--profile", str(profile), cwd=work)
    assert trained.returncode == 0, trained.stderr[-2000:]
    time.sleep(1.05 - time.time() % 1)  # the next second: a run dir named in the same one would get a -2
    sbatch = kforge("train", "--profile", str(profile), "--sbatch", cwd=work)
    assert sbatch.returncode == 0, sbatch.stderr[-2000:]
    runs = sorted(p for p in (work / "runs").iterdir())
    assert len(runs) == 2 and all(re.fullmatch(r"my-\d{8}-\d{6}", p.name) for p in runs), runs
    assert (
        sum((p / "job.sbatch").is_file() for p in runs) == 1 and sum((p / "metrics.jsonl").is_file() for p in runs) == 1
    )
    assert not list(profile.parent.glob("my.toml-*")), "a run directory was created next to the profile"


def test_first_screen_threads_banner_once_before_the_first_step_and_a_run_name_with_the_data(
    kforge, tmp_path: Path
) -> None:
    """The first screen: a line at once, one while the model builds, then the banner once, then the steps."""
    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(f"line {i} of a small corpus" for i in range(400)))
    data = tmp_path / "my data!"  # the run name keeps only safe characters
    assert kforge("prepare-data", str(src), "--out", str(data), "--quiet").returncode == 0
    meta = __import__("json").loads((data / "metadata.json").read_text())
    work = tmp_path / "work"
    work.mkdir()
    model = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1"]
    r = kforge(
        "train",
        f"--data.path={data}",
        *model,
        "--train.batch_size=2",
        "--train.seq_len=32",
        "--train.max_steps=3",
        "--scheduler.warmup_steps=1",
        "--eval.interval=2",
        "--eval.steps=3",
        "--checkpoint.interval=2",
        "--metrics.log_interval=2",
        "--metrics.progress_bar=off",
        "--train.num_threads=1",
        cwd=work,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = list((work / "runs").iterdir())
    assert re.fullmatch(r"cpu-debug-my-data-\d{8}-\d{6}", run.name), run.name
    lines = [line.split("[INFO] ", 1)[1] if "[INFO] " in line else line for line in r.stderr.splitlines()]
    assert lines[0] == "kforge: starting (loading PyTorch) ..."
    assert sum(line.startswith("kforge 0.") and ": training cpu-debug" in line for line in lines) == 1
    first = lines.index(next(line for line in lines if ": training cpu-debug" in line))
    building = lines.index(next(line for line in lines if line.startswith("building the model")))
    step1 = lines.index(next(line for line in lines if line.startswith("step 1/3")))
    assert building < first < step1
    banner = lines[first + 1 : step1]
    from kforge_cli.settings import load_settings

    total = load_settings(overrides=model).settings.model.param_count()
    train, val = meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]
    assert banner == [
        f"  model: {total / 1e3:,.1f}K parameters, dim 32, 1 layer, 2 heads (1 kv), vocab 320",
        "  step: 64 tokens (batch 2 x seq 32 x dp 1); 3 steps = 192 tokens",
        f"  data: {data} (byte tokenizer, {train:,} train + {val:,} val tokens)",
        "  mesh: 1 process, pp=1 dp_replicate=1 dp_shard=1 tp=1",
        "  device: cpu, compute fp32, 1 CPU thread per process (train.num_threads)",
        f"  run dir: {run}",
        f"  checkpoints: every 2 steps, and at the end, keep the last 2 -> {run / 'checkpoints'}",
        "  eval: every 2 steps and at the end, 3 held-out batches of 2 x 32 tokens",
        f"  trackers: jsonl ({run / 'metrics.jsonl'})",
    ]
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step 1/3", "step 2/3", "step 3/3"]
