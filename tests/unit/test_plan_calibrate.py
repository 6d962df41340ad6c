"""`kforge plan calibrate`: the fit recovers the constants trials were made with, and its [plan] section,
written into a trial's profile, makes `kforge plan` print the fitted step time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kforge_cli.engine.plan.calibrate import GBPS as GBPS_GRID
from kforge_cli.engine.plan.calibrate import MFUS, Calibration, calibrate, fragment_toml, with_plan_section
from kforge_cli.engine.plan.search import predict_step, search_layouts
from kforge_cli.engine.plan.written_profile import candidate_profile
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import load_settings

SMALL = [
    "--model.dim=128",
    "--model.n_layers=8",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.vocab_size=1000",
    "--train.seq_len=256",
    "--model.max_seq_len=256",
    "--train.batch_size=2",
    "--train.grad_accum_steps=4",
    "--slurm.gpus_per_node=8",
    "--slurm.gpu_type=h100",
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
]
MFU, GBPS = MFUS[11], GBPS_GRID[22]  # 0.0743, 82 GB/s: on the grid, compute and communication both count
TRUE = [f"--plan.mfu={MFU}", f"--plan.intra_node_gbps={GBPS}", f"--plan.inter_node_gbps={GBPS}"]
TRUE += ["--plan.full_speed_tokens=256"] + [f"--plan.{k}_overlap=0.5" for k in ("fsdp", "tp", "cp", "ep", "pp")]


@pytest.fixture(scope="module")
def trial_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four trials of the search's best layouts whose 'measured' step is the model's at constants on the grid."""
    out = tmp_path_factory.mktemp("trials")
    s = load_settings(overrides=SMALL, use_env=False).settings
    result = search_layouts(s, 8, top=4)
    trials = []
    for i, cand in enumerate(result.top, 1):
        here = out / f"trial-{i}"
        here.mkdir()
        (here / "profile.toml").write_text(candidate_profile(s, cand))
        truth = load_settings(profile=str(here / "profile.toml"), overrides=TRUE, use_env=False).settings
        trials.append(
            {
                "index": i,
                "layout": cand.layout.describe(),
                "world_size": 8,
                "profile": str(here / "profile.toml"),
                "predicted_step_s": cand.estimate.step_s,
                "measured_step_s": predict_step(truth, 8).step_s,
            }
        )
    trials.append({"index": 5, "layout": "failed", "world_size": 8, "profile": "x", "measured_step_s": None})
    summary = {"profile": "cpu-debug", "world_size": 8, "gpu_type": "h100", "steps": 10, "launcher": "local"}
    (out / "trials.json").write_text(json.dumps({**summary, "trials": trials}))
    return out


@pytest.fixture(scope="module")
def fitted(trial_dir: Path) -> Calibration:
    return calibrate(trial_dir)


def test_fit_recovers_the_constants(fitted: Calibration) -> None:
    c = fitted
    assert len(c.rows) == 4  # the failed trial is left out
    assert c.mean_abs_error_fitted < 1e-9 < c.mean_abs_error_default
    assert c.plan["mfu"] == MFU and c.plan["intra_node_gbps"] == c.plan["inter_node_gbps"] == GBPS
    assert c.plan["full_speed_tokens"] == 256 and c.plan["fsdp_overlap"] == 0.5
    assert 'extends = "cpu-debug"' in fragment_toml(c) and "[plan]" in fragment_toml(c)


def test_fitted_section_gives_the_fitted_step_in_kforge_plan(
    trial_dir: Path, fitted: Calibration, tmp_path: Path
) -> None:
    c = fitted
    profile = tmp_path / "tuned.toml"
    profile.write_text(with_plan_section((trial_dir / "trial-1" / "profile.toml").read_text(), c))
    assert profile.read_text().startswith("# Written by `kforge plan search --write-profile`")
    tuned = load_settings(profile=str(profile), use_env=False).settings
    assert tuned.plan.mfu == c.plan["mfu"]
    assert predict_step(tuned, 8).step_s == pytest.approx(c.rows[0]["fitted_s"], rel=1e-12)


def test_calibrate_command_writes_a_profile_fragment(trial_dir: Path, tmp_path: Path, capsys) -> None:
    from kforge_cli.cli.app import main

    out = tmp_path / "fit.toml"
    with pytest.raises(SystemExit) as done:
        main(["plan", "calibrate", str(trial_dir), "--output", str(out)])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "mean |error|: defaults" in printed and f"[plan]\nmfu = {MFU}" in printed
    assert load_settings(profile=str(out), use_env=False).settings.plan.mfu == MFU
    with pytest.raises(SystemExit) as refused:
        main(["plan", "calibrate", str(trial_dir), "--output", str(out)])
    assert refused.value.code == 2 and "exists; choose another file or pass --overwrite" in capsys.readouterr().err


def test_calibrate_refuses_a_directory_without_trials(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="trials.json does not exist"):
        calibrate(tmp_path)
