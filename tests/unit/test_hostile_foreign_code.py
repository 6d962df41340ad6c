"""Someone else's files never run code or pick the settings unasked (issue 29, third pass).

Class 1: hooks named by a file (a run's config.toml for `resume`, the job script's
`train --profile RUN/config.toml`, a profile, `--config`) are refused unless
`--allow-hooks` lists their modules, before anything is imported; `python -m kforge_cli`
does not import from the working directory. Class 2: a ./profiles file that shadows a
shipped profile is refused, and every resolution says where each profile file came from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import kforge_cli
from kforge_cli.cli.app import main
from kforge_cli.settings import load_settings
from kforge_cli.settings.explain import to_toml

SRC = Path(kforge_cli.__file__).resolve().parents[1]  # the kforge_cli under test


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """An importable module whose body leaves a marker file: (module name, marker)."""
    name = f"kforge_planted_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "IMPORTED"
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    code += "from kforge_cli.engine.train.hooks import TrainHook\nclass Payload(TrainHook):\n    pass\n"
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(pkg))
    return name, marker


def foreign_run(tmp_path: Path, module: str) -> Path:
    """A run directory whose config.toml (written by a colleague) names a hook in `module`."""
    run = tmp_path / "colleague_run"
    run.mkdir()
    settings = load_settings(
        overrides=[f'--train.hooks=["{module}:Payload"]', "--model.dim=32", "--train.max_steps=1"], use_env=False
    ).settings
    (run / "config.toml").write_text(to_toml(settings))
    return run


TINY = ["--train.device=cpu", "--metrics.progress_bar=off", "--checkpoint.interval=0"]


def test_resume_refuses_hooks_from_the_saved_config_unless_allowed(
    tmp_path: Path, planted: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    module, marker = planted
    run = foreign_run(tmp_path, module)
    before = (run / "config.toml").read_bytes()
    code, _, err = run_cli(["resume", str(run), "--checkpoint.resume=auto", *TINY], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"{run / 'config.toml'}" in err and f"{module}:Payload" in err and f"--allow-hooks={module}" in err
    assert not marker.exists() and (run / "config.toml").read_bytes() == before  # nothing ran, nothing changed
    code, _, err = run_cli(["resume", str(run), "--allow-hooks", "other.module", "--checkpoint.resume=auto"], capsys)
    assert code == 2 and not marker.exists(), err
    code, _, err = run_cli(["resume", str(run), f"--allow-hooks={module}", "--checkpoint.resume=auto", *TINY], capsys)
    assert code == 0 and marker.read_text() == "ran", err  # the explicit yes imports it


def test_the_job_scripts_command_refuses_hooks_its_config_gained_later(
    tmp_path: Path, planted: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """job.sbatch runs `train --profile RUN/config.toml`: a config naming hooks is a file naming code."""
    module, marker = planted
    run = foreign_run(tmp_path, module)
    profile = str(run / "config.toml")
    code, _, err = run_cli(["train", "--profile", profile, "--run-dir", str(run), *TINY], capsys)
    assert code == 2 and f"--allow-hooks={module}" in err and not marker.exists(), err
    config = tmp_path / "mine.toml"  # a --config file is a file too
    config.write_text(f'[train]\nhooks = ["{module}:Payload"]\n')
    code, _, err = run_cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "r2"), *TINY], capsys)
    assert code == 2 and "mine.toml" in err and not marker.exists(), err


def test_a_generated_job_allows_exactly_the_hooks_allowed_when_it_was_written(
    tmp_path: Path, planted: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.slurm import train_command

    module, _ = planted
    run = tmp_path / "run"
    hooks = f'--train.hooks=["{module}:Payload"]'  # typed on the command line: the user's own choice
    code, out, err = run_cli(["train", "--sbatch", "--run-dir", str(run), hooks], capsys)
    assert code == 0, err
    assert f"--run-dir {run} --allow-hooks={module} &" in out
    assert train_command(run, "python") == ["python", "-m", "kforge_cli", "train", "--run-dir", str(run)]
    code, out, err = run_cli(["resume", str(run), "--sbatch", "--checkpoint.resume=auto"], capsys)
    assert code == 2 and f"--allow-hooks={module}" in err, err


def test_python_m_kforge_cli_does_not_import_from_the_working_directory(tmp_path: Path) -> None:
    """The job script's `python -m kforge_cli` runs in a directory others can write to."""
    work = tmp_path / "shared_workdir"
    work.mkdir()
    marker = tmp_path / "IMPORTED"
    (work / "evilhooks.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KFORGE_")}
    env["PYTHONPATH"] = str(SRC)
    cmd = [sys.executable, "-m", "kforge_cli", "train", '--train.hooks=["evilhooks:Payload"]', "--run-dir", "r"]
    r = subprocess.run([*cmd, *TINY], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "cannot import module 'evilhooks'" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory (a colleague's project) with its own ./profiles, no KFORGE_* variables."""
    work = tmp_path / "project"
    (work / "profiles").mkdir(parents=True)
    monkeypatch.chdir(work)
    for key in [k for k in os.environ if k.startswith("KFORGE_")]:
        monkeypatch.delenv(key)
    return work


@pytest.mark.parametrize("name", ["cpu-debug", "h100x8"])  # the default one, and one a shipped profile extends
def test_a_local_profile_shadowing_a_shipped_one_is_refused(
    elsewhere: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    planted = elsewhere / "profiles" / f"{name}.toml"
    planted.write_text('[checkpoint]\ndir = "/tmp/somewhere-else"\n')
    args = ["validate-config"] if name == "cpu-debug" else ["validate-config", "--profile", "h100x64"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"{planted}" in err and "would silently replace it" in err and f"--profile {planted}" in err
    code, _, err = run_cli(["validate-config", "--profile", str(planted)], capsys)  # by path: deliberate
    assert code in (0, 2) and "would silently replace" not in err, err


def test_every_resolution_says_where_each_profile_file_came_from(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.settings.profiles import find_profile

    mine = elsewhere / "profiles" / "mine.toml"
    mine.write_text('extends = "cpu-debug"\n[train]\nmax_steps = 7\n')
    code, _, err = run_cli(["validate-config", "--profile", "mine"], capsys)
    assert code == 0, err
    shipped = find_profile("cpu-debug")
    assert f"profile mine: {mine} (./profiles)" in err and f"extends cpu-debug: {shipped} (shipped)" in err
    site = tmp_path / "site"  # the user's own $KFORGE_PROFILE_PATH may shadow one, loudly
    site.mkdir()
    (site / "cpu-debug.toml").write_text("[train]\nmax_steps = 5\n")
    monkeypatch.setenv("KFORGE_PROFILE_PATH", str(site))
    code, _, err = run_cli(["validate-config"], capsys)
    assert code == 0, err
    assert f"warning: profile: {site / 'cpu-debug.toml'} from $KFORGE_PROFILE_PATH SHADOWS the shipped" in err
