"""`kforge plan trial --best 3 --steps 10` on 4 gloo ranks: predicted beside measured, then calibrated.

A tiny model on the CPU: this checks the machinery (the three best layouts trained for 10
steps each by the built-in launcher, their metrics read back, the table ranked by the
measurement), that each trial's prediction is the search's and the one `kforge plan` prints for
the trial's profile, and that `kforge plan calibrate` fits the trials it wrote. Not GPU truth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

TINY = ["--model.dim=64", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2", "--train.seq_len=64"]


def test_three_trials_on_four_gloo_ranks(kforge, tmp_path: Path) -> None:
    out = tmp_path / "trials"
    args = ["plan", "trial", "--world-size", "4", "--best", "3", "--steps", "10", "--trial-dir", str(out)]
    r = kforge(*args, "--format", "json", "--slurm.gpus_per_node=4", *TINY)
    assert r.returncode == 0, r.stderr[-3000:]
    search = json.loads(r.stdout)
    summary = json.loads((out / "trials.json").read_text())
    assert summary["launcher"] == "local" and summary["steps"] == 10 and summary["warmup_steps"] == 2
    trials = summary["trials"]
    assert [t["index"] for t in trials] == [1, 2, 3]
    for t, predicted in zip(trials, search["top"], strict=False):
        assert t["exit_code"] == 0 and t["world_size"] == 4
        assert t["predicted_step_s"] == pytest.approx(predicted["predicted"]["step_s"])
        assert t["measured_step_s"] > 0 and t["timed_steps"] == 8 and t["measured_peak_gib"] > 0
        assert t["error"] == pytest.approx((t["predicted_step_s"] - t["measured_step_s"]) / t["measured_step_s"])
        assert (Path(t["run_dir"]) / "metrics.jsonl").is_file()
    table = r.stderr[r.stderr.index("trials: 10 steps each") :].splitlines()[2:5]
    measured = sorted(trials, key=lambda t: t["measured_step_s"])
    assert [int(line.split()[1]) for line in table] == [t["index"] for t in measured]  # ranked by the measurement
    first = kforge("plan", "--profile", trials[0]["profile"], "--format", "json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["step"]["step_s"] == trials[0]["predicted_step_s"]  # one figure per layout
    fit = tmp_path / "fit.toml"
    c = kforge("plan", "calibrate", str(out), "--output", str(fit))
    assert c.returncode == 0, c.stderr
    assert "mean |error|: defaults" in c.stdout and fit.is_file()
    tuned = kforge("plan", "--profile", str(fit), "--format", "json")
    assert tuned.returncode == 0, tuned.stderr
