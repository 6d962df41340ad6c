"""What a stopped run says to continue it, and a second Ctrl-C once its checkpoint is saved (issue 41)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from kforge_cli.cli.app import main


def test_the_resume_command_starts_the_run_the_way_it_ran() -> None:
    from kforge_cli.cli.outcome import resume_command

    local = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "KFORGE_LOCAL_CHILD": "1"}
    assert resume_command(Path("/r/x"), env=local) == "kforge resume /r/x --nproc-per-node 4"
    hooks = ["my_pkg.hooks:Clock"]
    assert (
        resume_command(Path("/r/x"), hooks, env=local)
        == "kforge resume /r/x --allow-hooks=my_pkg.hooks --nproc-per-node 4"
    )
    torchrun = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    assert resume_command(Path("/r/x"), env=torchrun) == "torchrun --nproc-per-node=8 -m kforge_cli resume /r/x"
    nodes = {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert resume_command(Path("/r/x"), env=nodes).startswith("torchrun on 16 processes (8 per node), each running: ")
    assert resume_command(Path("/r/x"), env={}) == "kforge resume /r/x"


def test_resume_starts_the_recorded_processes_unless_typed_or_already_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kforge_cli.cli.local_job import run_processes

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    assert run_processes(tmp_path) is None  # no launch.json: one process, as before
    (tmp_path / "launch.json").write_text(json.dumps({"launcher": "local", "nproc_per_node": 4, "world_size": 4}))
    assert run_processes(tmp_path) == 4
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert run_processes(tmp_path) is None  # a rank of the launched job runs itself
    monkeypatch.delenv("RANK")
    (tmp_path / "launch.json").write_text(json.dumps({"launcher": "torchrun", "nproc_per_node": 8}))
    assert run_processes(tmp_path) is None  # torchrun's job is relaunched by torchrun


def test_a_second_ctrl_c_after_the_stop_checkpoint_exits_75(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.engine.resilience import ShutdownHandler
    from kforge_cli.errors import SavedInterrupt

    previous = signal.getsignal(signal.SIGINT)
    try:
        handler = ShutdownHandler(["SIGINT"])
        handler._on_signal(signal.SIGINT, None)  # the first: stop at the next step boundary
        with pytest.raises(KeyboardInterrupt) as info:  # the second, during the save: 130
            handler._on_signal(signal.SIGINT, None)
        assert not isinstance(info.value, SavedInterrupt)
        handler.saved_step = 23  # the stop's checkpoint is complete
        with pytest.raises(SavedInterrupt):
            handler._on_signal(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous)

    def interrupted(settings: object) -> object:
        raise SavedInterrupt(23)

    monkeypatch.setattr("kforge_cli.engine.train.run_training", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--train.max_steps=1"])
    assert exit_info.value.code == 75
    assert "interrupted after the checkpoint of step 23 was saved" in capsys.readouterr().err


def test_the_schedule_warning_is_worded_for_a_longer_and_a_shorter_run() -> None:
    from kforge_cli.cli.resume import schedule_change_warning
    from kforge_cli.settings import load_settings

    def s(steps: int) -> object:
        return load_settings(overrides=[f"--train.max_steps={steps}"], use_env=False).settings

    longer, shorter = schedule_change_warning(s(40), s(80)), schedule_change_warning(s(80), s(40))  # type: ignore[arg-type]
    assert longer is not None and "it rises again where the old schedule had decayed" in longer
    assert shorter is not None and "rises again" not in shorter
    assert "it decays faster from the checkpoint on, to its end at step 40" in shorter


@pytest.mark.parametrize("typo", ["--run-dri", "--run-dri=runs/x"])
def test_a_misspelt_option_suggests_the_option(typo: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", typo, *(["runs/x"] if "=" not in typo else [])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "did you mean --run-dir" in err and "train.run_dir" not in err, err


def test_explain_shows_a_readable_type_and_a_comma_list_gets_the_bracket_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["validate-config", "--explain", "optimizer.betas"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "  type:    tuple[float, float], each in [0, 1)\n" in out, out
    with pytest.raises(SystemExit) as exit_info:
        main(["validate-config", "--optimizer.betas=0.9,0.95"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "write a list in brackets: --optimizer.betas=[0.9,0.95]" in err, err


def test_a_hook_that_cannot_be_imported_names_sys_path_and_the_fix() -> None:
    from kforge_cli.engine.train.hooks import load_hook
    from kforge_cli.errors import InvalidInputError
    from kforge_cli.settings import load_settings

    settings = load_settings(use_env=False).settings
    with pytest.raises(InvalidInputError) as info:
        load_hook("my_pkg_not_here.hooks:BestEvalLoss", settings)
    message = str(info.value)
    assert "cannot import module 'my_pkg_not_here.hooks'" in message and "sys.path" in message
    assert "run from the directory that holds my_pkg_not_here/ with PYTHONPATH=." in message
    extending = (Path(__file__).parents[2] / "docs" / "extending.md").read_text()
    assert "    PYTHONPATH=. kforge train --eval.interval=100 --train.hooks=" in extending


def test_a_profile_error_names_its_source_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, unknown = tmp_path / "bad.toml", tmp_path / "unknown.toml"
    bad.write_text('[optimizer]\nlr = "abc"\n')
    unknown.write_text("[optimizr]\nlr = 1\n")
    for path, line in (
        (bad, f"(got 'abc') [from profile {bad}]\n"),
        (unknown, f"optimizr: unknown key (from profile {unknown}); did you mean optimizer?"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["validate-config", "-p", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and line in err and err.count(path.name) == 1, err
