"""Checkpoint directories without torch I/O: completeness, resolution, retention, fingerprint, resume config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kforge_cli.cli.resume import resolve_resume
from kforge_cli.engine.checkpoint import CheckpointError, fingerprint, resolve_checkpoint, shaping_config
from kforge_cli.errors import ConfigError
from kforge_cli.rundir.checkpoints import is_complete, newest_complete, prune, read_latest, write_latest
from kforge_cli.rundir.saved_config import continuation_issues, has_checkpoint
from kforge_cli.settings import load_settings
from kforge_cli.settings.explain import to_toml


def fake_checkpoint(root: Path, step: int, *, complete: bool = True, stages: int = 1) -> Path:
    d = root / f"step_{step}"
    dirs = [f"pp_{s}" for s in range(stages)] if stages > 1 else ["."]
    for sub in dirs:
        (d / sub).mkdir(parents=True, exist_ok=True)
        (d / sub / ".metadata").write_bytes(b"x")
    if complete:
        (d / "kforge_commit.json").write_text(json.dumps({"step": step, "dcp_dirs": dirs}))
    return d


def test_complete_means_commit_marker_and_every_stage_metadata(tmp_path: Path) -> None:
    assert is_complete(fake_checkpoint(tmp_path, 1))
    assert not is_complete(fake_checkpoint(tmp_path, 2, complete=False))
    pp = fake_checkpoint(tmp_path, 3, stages=2)
    assert is_complete(pp)
    (pp / "pp_1" / ".metadata").unlink()  # one stage never finished
    assert not is_complete(pp)
    assert newest_complete(tmp_path) == (tmp_path / "step_1", [tmp_path / "step_3", tmp_path / "step_2"])


def test_resolve_checkpoint_from_run_dir_checkpoints_dir_or_step_dir(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 10)
    fake_checkpoint(root, 20)
    fake_checkpoint(root, 30, complete=False)
    assert resolve_checkpoint(tmp_path / "run") == root / "step_20"
    assert resolve_checkpoint(root) == root / "step_20"
    assert resolve_checkpoint(root / "step_10") == root / "step_10"
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        resolve_checkpoint(root / "step_30")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")


def test_retention_never_deletes_latest_or_in_flight(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 6, complete=False)  # in flight
    stale = fake_checkpoint(tmp_path, 0, complete=False)  # leftover of a killed save
    write_latest(tmp_path, tmp_path / "step_2")
    deleted = prune(tmp_path, keep_last_n=2, protect={tmp_path / "step_6"})
    assert sorted(p.name for p in deleted) == ["step_0", "step_1", "step_3"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_2", "step_4", "step_5", "step_6"]
    assert read_latest(tmp_path) == tmp_path / "step_2" and not stale.exists()
    assert prune(tmp_path, keep_last_n=0, protect=set()) == []  # 0 keeps every complete one


def test_fingerprint_covers_model_shape_only() -> None:
    base = load_settings(use_env=False).settings
    same = load_settings(
        overrides=["--model.init_std=0.01", "--train.max_steps=70", "--optimizer.lr=1"], use_env=False
    ).settings
    other = load_settings(overrides=["--model.n_kv_heads=1"], use_env=False).settings
    assert fingerprint(shaping_config(base)) == fingerprint(shaping_config(same))
    assert fingerprint(shaping_config(base)) != fingerprint(shaping_config(other))
    assert shaping_config(base)["model.dim"] == 128 and "model.init_std" not in shaping_config(base)


def saved_run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints", 5)
    s = load_settings(overrides=[f"--train.run_dir={run}"], use_env=False).settings
    (run / "config.toml").write_text(to_toml(s))
    return run


def test_resume_refuses_shape_changing_overrides_naming_them(tmp_path: Path) -> None:
    run = saved_run_dir(tmp_path)
    with pytest.raises(ConfigError) as err:
        resolve_resume(run, ["--model.dim=64", "--model.n_layers=2", "--train.max_steps=90"])
    assert err.value.exit_code == 2
    assert [i.path for i in err.value.issues] == ["model.dim", "model.n_layers"]
    assert "128 -> 64" in str(err.value) and "command line --model.dim" in str(err.value)


def test_resume_uses_saved_config_with_allowed_overrides(tmp_path: Path) -> None:
    run = saved_run_dir(tmp_path)
    (run / "config.toml").write_text((run / "config.toml").read_text().replace("lr = 0.003", "lr = 0.005"))
    resolved = resolve_resume(run, ["--train.max_steps=900"])
    s = resolved.settings
    assert (s.train.max_steps, s.optimizer.lr, s.checkpoint.resume, s.train.run_dir) == (
        900,
        0.005,
        "require",
        str(run),
    )


def test_a_checkpoint_refuses_shape_and_data_order_changes_and_allows_the_rest(tmp_path: Path) -> None:
    run = saved_run_dir(tmp_path)
    saved = load_settings(overrides=[f"--train.run_dir={run}"], use_env=False).settings
    assert has_checkpoint(run, saved)

    def issues(*overrides: str, checkpoint: bool = True) -> list[str]:
        new = load_settings(overrides=[*overrides, f"--train.run_dir={run}"], use_env=False).settings
        return [str(i) for i in continuation_issues(saved, new, checkpoint=checkpoint)]

    assert issues("--model.dim=256") == ["model.dim: 128 -> 256 would change the model's shape (the run has 128)"]
    assert issues("--train.seq_len=64", "--train.seed=7") == [
        "train.seq_len: 128 -> 64 would change the data order its checkpoint continues (the run has 128)",
        "train.seed: 42 -> 7 would change the data order its checkpoint continues (the run has 42)",
    ]
    assert issues("--train.max_steps=5000", "--optimizer.lr=1e-4", "--train.data_seed=42") == []
    assert issues("--model.dim=256", checkpoint=False) == []  # nothing to continue: any change is allowed
