"""Early stopping on an eval-loss plateau (``train.early_stop_patience``): the component written as a user
would (engine/train/components/early_stop.py), through the real loop, the CLI's exit code and `kforge runs`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kforge_cli.cli.outcome import exit_code
from kforge_cli.cli.runs_table import describe_run
from kforge_cli.engine.train import run_training
from kforge_cli.settings import load_settings

TINY = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--train.seq_len=16",
    "--train.batch_size=2",
    "--train.max_steps=8",
    "--train.device=cpu",
    "--train.mixed_precision=fp32",
    "--train.num_threads=1",
    "--eval.interval=1",
    "--eval.steps=1",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=0",
    # no eval loss is better by 100: every evaluation after the first counts against the patience
    "--train.early_stop_min_delta=100",
]


def _settings(run: Path, *extra: str) -> Any:
    return load_settings(overrides=[*TINY, f"--train.run_dir={run}", *extra], use_env=False).settings


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_plateau_stops_the_run_with_exit_0_a_record_and_a_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    outcome = run_training(_settings(run, "--train.early_stop_patience=2"))
    assert outcome.status == "early_stop" and outcome.step == 3  # evals at 1 (best), 2 and 3 (no better)
    assert outcome.reason is not None and "train.early_stop_patience = 2" in outcome.reason
    assert exit_code(outcome) == 0
    stops = [r for r in _records(run) if "early_stop" in r]
    assert len(stops) == 1 and stops[0]["step"] == 3 and stops[0]["early_stop/evals_without_improvement"] == 2
    assert stops[0]["early_stop/best_step"] == 1
    assert max(r["step"] for r in _records(run) if "loss" in r) == 3
    summary = json.loads((run / "checkpoints" / "step_3" / "metadata.json").read_text())
    assert summary["reason"] == "early_stop"
    saved = json.loads((run / "checkpoints" / "step_3" / "train_state.json").read_text())
    assert saved["parts"]["early_stop"] == {"best": stops[0]["early_stop/best_eval_loss"], "best_step": 1, "stale": 2}
    assert describe_run(run, now=10**12).status == "early_stop"  # `kforge runs`

    # resumed as it was: it says so and stops again without training
    again = run_training(_settings(run, "--train.early_stop_patience=2"))
    assert again.status == "early_stop" and again.step == 3
    assert max(r["step"] for r in _records(run) if "loss" in r) == 3

    # told to continue (a higher patience): two more evaluations, then it stops again
    more = run_training(_settings(run, "--train.early_stop_patience=4"))
    assert more.status == "early_stop" and more.step == 5

    # patience off: the run trains to train.max_steps
    done = run_training(_settings(run, "--train.early_stop_patience=0"))
    assert done.status == "completed" and done.step == 8
    assert describe_run(run, now=10**12).status == "done"


def test_off_by_default(tmp_path: Path) -> None:
    outcome = run_training(_settings(tmp_path / "run", "--train.max_steps=3"))
    assert outcome.status == "completed" and outcome.step == 3
    assert not [r for r in _records(tmp_path / "run") if "early_stop" in r]
