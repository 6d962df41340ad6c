"""Writes into a run directory never follow a symbolic link (logs, metrics.jsonl, config, checkpoints)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from kforge_cli.engine.observe.logs import setup_logging, shutdown_logging
from kforge_cli.engine.observe.metrics_file import MetricsFile
from kforge_cli.engine.train.run_dir import write_config
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.checkpoints import atomic_write_bytes, write_latest
from kforge_cli.settings import load_settings

SECRET = "ssh-ed25519 AAAA... precious\n"


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A file outside the run (think ~/.ssh/authorized_keys) that links in the run point at."""
    t = tmp_path / "outside" / "authorized_keys"
    t.parent.mkdir()
    t.write_text(SECRET)
    return t


def test_symlinked_rank_log_is_refused(tmp_path: Path, target: Path) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    os.symlink(target, logs / "rank_0.log")
    with pytest.raises(KforgeError, match=r"rank_0\.log: this file is a symbolic link") as err:
        setup_logging(0, 1, logs)
    shutdown_logging()
    assert err.value.exit_code == 2 and target.read_text() == SECRET


def test_symlinked_logs_dir_and_metrics_file_are_refused(tmp_path: Path, target: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target.parent, run / "logs")
    with pytest.raises(KforgeError, match="this directory is a symbolic link"):
        setup_logging(0, 1, run / "logs")
    shutdown_logging()
    os.symlink(target, run / "metrics.jsonl")
    with pytest.raises(KforgeError, match=r"metrics\.jsonl"):
        MetricsFile(run / "metrics.jsonl")
    assert target.read_text() == SECRET and sorted(p.name for p in target.parent.iterdir()) == ["authorized_keys"]


def test_planted_temporary_files_and_links_at_the_final_name_are_never_written_through(
    tmp_path: Path, target: Path
) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    pid = os.getpid()
    os.symlink(target, run / f".config.toml.tmp{pid}")
    os.symlink(target, run / "checkpoints" / f".latest.tmp{pid}")
    settings = load_settings(use_env=False).settings
    write_config(settings, run)
    write_latest(run / "checkpoints", run / "checkpoints" / "step_3")
    assert (run / "config.toml").read_text().startswith("profile") or "[model]" in (run / "config.toml").read_text()
    assert (run / "checkpoints" / "latest").read_text() == "step_3\n"
    os.symlink(target, run / "job.sbatch")  # a link at the final name is replaced, not followed
    atomic_write_bytes(run / "job.sbatch", b"#!/bin/bash\n")
    assert not (run / "job.sbatch").is_symlink() and target.read_text() == SECRET


def test_train_refuses_a_run_dir_with_a_symlinked_log_and_a_run_dir_that_is_a_file(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    os.symlink(target, run / "logs" / "rank_0.log")
    args = [
        "--train.device=cpu",
        "--train.max_steps=1",
        "--scheduler.warmup_steps=0",
        "--model.dim=32",
        "--model.n_layers=1",
        "--model.n_heads=2",
    ]
    for run_dir, why in ((run, "symbolic link"), (target, "is a file, not a directory")):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--run-dir", str(run_dir), *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and why in err and "Traceback" not in err, err
    shutdown_logging()
    assert target.read_text() == SECRET


class NotAHook:
    """Would end the process if kforge instantiated it before checking its type."""

    def __init__(self) -> None:
        raise SystemExit("NotAHook was instantiated")


def test_hooks_are_type_checked_before_instantiation_and_resume_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.resume import resolve_resume
    from kforge_cli.engine.train.hooks import load_hook
    from kforge_cli.settings.explain import to_toml

    settings = load_settings(use_env=False).settings
    for spec in ("sys:exit", f"{__name__}:NotAHook"):
        with pytest.raises(KforgeError, match="not a kforge_cli.engine.train.TrainHook subclass"):
            load_hook(spec, settings)
    saved = load_settings(overrides=['--train.hooks=["evil.module:Payload"]'], use_env=False).settings
    (tmp_path / "config.toml").write_text(to_toml(saved))
    with pytest.raises(KforgeError, match=r"imported and run: evil\.module:Payload.*--allow-hooks=evil\.module"):
        resolve_resume(
            tmp_path, ["--checkpoint.resume=auto"]
        )  # refused unless allowed (tests/unit/test_hostile_foreign_code.py)


def test_a_symlinked_checkpoints_root_is_refused_before_anything_is_read_written_or_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.unit.test_checkpoint_manager import make_run, train

    precious = make_run(tmp_path / "precious")
    precious.manager.restore()
    for step in (1, 2):
        train(precious, 1)
        precious.manager.save(step)
    elsewhere = tmp_path / "precious" / "checkpoints"
    before = sorted(p.name for p in elsewhere.iterdir())
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere, run / "checkpoints")
    with pytest.raises(KforgeError, match=r"checkpoints is a symbolic link \(to .*precious/checkpoints\)") as err:
        make_run(run, ["--checkpoint.keep_last_n=1"])
    assert err.value.exit_code == 2
    code = 0
    try:
        main(["train", "--run-dir", str(run), "--train.device=cpu", "--train.max_steps=1", "--model.dim=32"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    shutdown_logging()
    message = capsys.readouterr().err
    assert code == 2 and "is a symbolic link" in message and "Traceback" not in message, message
    assert sorted(p.name for p in elsewhere.iterdir()) == before and (elsewhere / "step_1").is_dir()


def test_eval_results_are_never_written_through_a_planted_link(tmp_path: Path, target: Path) -> None:
    from types import SimpleNamespace

    from kforge_cli.engine.evaluation.tasks import write_results

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    os.symlink(target, run / "eval" / "step_3.json.tmp")
    os.symlink(target, run / "eval" / f".step_3.json.tmp{os.getpid()}")
    loaded = SimpleNamespace(run_dir=run, step=3, path=run / "checkpoints" / "step_3")
    path = write_results(loaded, {"heldout": {"loss": 1.5}})  # type: ignore[arg-type]
    assert path == run / "eval" / "step_3.json" and not path.is_symlink()
    assert json.loads(path.read_text())["tasks"] == {"heldout": {"loss": 1.5}} and target.read_text() == SECRET
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(target.parent, other / "eval")
    with pytest.raises(KforgeError, match="this directory is a symbolic link"):
        write_results(SimpleNamespace(run_dir=other, step=1, path=other), {})  # type: ignore[arg-type]
    assert sorted(p.name for p in target.parent.iterdir()) == ["authorized_keys"]
