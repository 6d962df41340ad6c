"""Nothing lost: one run per directory (lock), fresh default names, no foreign dirs, resume=never refused."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.run_dir import resolve_run_dir
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.claim import release_run_dir
from kforge_cli.rundir.lock import acquire_run_lock
from kforge_cli.rundir.names import LOCK_FILE
from kforge_cli.settings import load_settings
from tests.unit.test_checkpoint_manager import make_run, train


def settings_for(run_dir: Path | None) -> object:
    extra = [f"--train.run_dir={run_dir}"] if run_dir else []
    return load_settings(overrides=["--train.device=cpu", *extra], use_env=False).settings


def test_a_second_run_on_a_locked_dir_is_refused_and_the_lock_is_released_after(tmp_path: Path) -> None:
    s = settings_for(tmp_path / "run")
    runtime = init_runtime(s)  # type: ignore[arg-type]
    run_dir = resolve_run_dir(s, runtime)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=rf"in use by another kforge run \(pid {os.getpid()} on ") as err:
        resolve_run_dir(s, runtime)  # type: ignore[arg-type]
    assert err.value.exit_code == 2
    release_run_dir(run_dir)
    again = resolve_run_dir(s, runtime)  # type: ignore[arg-type]
    release_run_dir(again)


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kforge")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 2**22 + 17, "host": "node7", "since": "yesterday"}))
    with acquire_run_lock(run):
        record = json.loads((run / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
    assert "taking over from pid 4194321 on node7" in caplog.text


def test_default_run_dirs_started_in_the_same_second_are_distinct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "20260101-000000")
    s = settings_for(None)
    runtime = init_runtime(s)  # type: ignore[arg-type]
    a = resolve_run_dir(s, runtime)  # type: ignore[arg-type]
    b = resolve_run_dir(s, runtime)  # type: ignore[arg-type]
    assert a != b and a.name == "cpu-debug-20260101-000000" and b.name == "cpu-debug-20260101-000000-2"
    release_run_dir(a)
    release_run_dir(b)


def test_an_existing_non_kforge_directory_is_refused(tmp_path: Path) -> None:
    project = tmp_path / "my_project"
    project.mkdir()
    (project / "config.toml").write_text("[tool.black]\nline-length = 100\n")
    s = settings_for(project)
    with pytest.raises(InvalidInputError, match="not a kforge run directory"):
        resolve_run_dir(s, init_runtime(s))  # type: ignore[arg-type]
    assert (project / "config.toml").read_text() == "[tool.black]\nline-length = 100\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    s2 = settings_for(empty)
    release_run_dir(resolve_run_dir(s2, init_runtime(s2)))  # type: ignore[arg-type]


def test_resume_never_in_a_dir_with_older_checkpoints_is_refused(tmp_path: Path) -> None:
    old = make_run(tmp_path)
    old.manager.restore()
    train(old, 1)
    old.manager.save(1)
    fresh = make_run(tmp_path, ["--checkpoint.resume=never"])
    with pytest.raises(CheckpointError, match="resume = 'never', but .* already holds checkpoints .*step_1") as err:
        fresh.manager.restore()
    assert err.value.exit_code == 2
    assert make_run(tmp_path / "new", ["--checkpoint.resume=never"]).manager.restore() is None


def test_a_requeued_slurm_job_waits_for_the_old_lock_to_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    old = acquire_run_lock(run)  # the job's previous incarnation, still releasing its lock
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    threading.Timer(0.5, old.release).start()
    with acquire_run_lock(run) as new:  # requeued: waits (up to REQUEUE_WAIT_S) instead of failing
        assert json.loads((run / LOCK_FILE).read_text())["slurm_job_id"] == "4242"
    assert new is not None


def test_default_run_names_carry_the_data_name() -> None:
    from kforge_cli.rundir.layout import run_name
    from kforge_cli.settings import load_settings

    def name(*overrides: str, profile: str | None = None) -> str:
        return run_name(load_settings(profile=profile, overrides=list(overrides), use_env=False).settings)

    assert name() == "cpu-debug"  # the built-in corpus: the profile alone, as before
    assert name("--data.path=/scratch/data/fineweb-10B/") == "cpu-debug-fineweb-10B"
    assert name("--data.path=/d/my data (v2)") == "cpu-debug-my-data-v2"
    five = ", ".join(f'{{name="d{i}", path="/d/{i}"}}' for i in range(5))
    assert name(f"--data.datasets=[{five}]") == "cpu-debug-d0+d1+d2+2more"
    assert len(name(f"--data.path=/d/{'x' * 100}")) == len("cpu-debug-") + 40
