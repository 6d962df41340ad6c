"""The first hour's small things: warnings once per job, did-you-mean for torchrun/HF spellings, help text."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kforge_cli.cli.app import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out = capsys.readouterr()
    return int(exit_info.value.code or 0), out.out, out.err


def test_oversubscription_is_warned_once_by_the_launcher() -> None:
    from kforge_cli.engine.runtime.local_launch import _child_env, oversubscription_warning

    assert oversubscription_warning(2, 2) is None and oversubscription_warning(1, 16) is None
    text = oversubscription_warning(8, 2)
    assert text is not None and text.startswith("warning: --nproc-per-node 8 starts 8 training processes on 2 cores")
    assert "slower than --nproc-per-node 2" in text
    assert "1 core:" in (oversubscription_warning(2, 1) or "")
    rank0, rank3 = _child_env(4, 0, 1234), _child_env(4, 3, 1234)
    assert rank0["KFORGE_LOCAL_CHILD"] == rank3["KFORGE_LOCAL_CHILD"] == "1"
    if "TORCH_CPP_LOG_LEVEL" not in rank0:  # unless the user set it: C++ warnings from rank 0 only
        assert rank3["TORCH_CPP_LOG_LEVEL"] == "ERROR"


@pytest.mark.parametrize(
    ("env", "printed"),
    [({}, True), ({"RANK": "1"}, False), ({"SLURM_PROCID": "2"}, False), ({"KFORGE_LOCAL_CHILD": "1"}, False)],
)
def test_config_warnings_are_printed_by_one_process_of_a_job(
    env: dict[str, str], printed: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in ("RANK", "SLURM_PROCID", "KFORGE_LOCAL_CHILD"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = _run(capsys, "validate-config", "--train.max_steps=5")  # warmup 20 > 5 steps: a warning
    assert code == 0 and ("warning: scheduler.warmup_steps" in err) == printed, err


def test_python_warnings_of_other_ranks_go_to_their_file_only(tmp_path: Path) -> None:
    """A library warning raised on every rank is printed by rank 0; rank N keeps it in logs/rank_N.log."""
    import subprocess

    code = (
        "import sys, warnings\n"
        "from kforge_cli.engine.observe.logs import setup_logging, shutdown_logging\n"
        "rank = int(sys.argv[1])\n"
        "setup_logging(rank, 4, __import__('pathlib').Path(sys.argv[2]))\n"
        "warnings.warn('DTensor random operators may not have complete support', UserWarning)\n"
        "shutdown_logging()\n"
        "warnings.warn('after shutdown: printed again', UserWarning)\n"
    )
    for rank in (0, 3):
        r = subprocess.run([sys.executable, "-c", code, str(rank), str(tmp_path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert ("DTensor random" in r.stderr) == (rank == 0), r.stderr
        assert "after shutdown: printed again" in r.stderr
    assert "DTensor random" in (tmp_path / "rank_3.log").read_text()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["validate-config", "--learning_rate=1e-3"], "did you mean --optimizer.lr=1e-3?"),
        (["validate-config", "--max_steps", "5"], "did you mean --train.max_steps?"),
        (["validate-config", "--world_size=2"], "unexpected argument '--world_size=2': did you mean --world-size 2?"),
        (["train", "--nproc_per_node=2"], "unexpected argument '--nproc_per_node=2': did you mean --nproc-per-node 2?"),
    ],
)
def test_underscore_spellings_get_a_did_you_mean(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and expected in err and "Traceback" not in err, err


def test_help_names_arguments_in_capitals_flags_without_bool_and_format_as_choices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = _run(capsys, "resume", "--help")
    assert code == 0 and "Usage: kforge resume [OPTIONS] RUN_DIR" in out and "{" not in out.splitlines()[1]
    assert "RUN_DIR      <path>" in out
    assert not [line for line in out.splitlines() if ("--sbatch" in line or "--help" in line) and "<bool>" in line]
    code, out, _ = _run(capsys, "validate-config", "--help")
    assert code == 0 and "<toml|json>" in out
    code, _, err = _run(capsys, "validate-config", "--format", "yaml")
    assert code == 2 and "'yaml' is not one of" in err


def test_profiles_listing_fits_100_columns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KFORGE_PROFILE_PATH", raising=False)
    monkeypatch.chdir(Path(__file__).parent)  # no ./profiles: the shipped ones, short headers
    code, out, _ = _run(capsys, "profiles")
    lines = out.splitlines()
    assert code == 0 and len(lines) > 10 and max(map(len, lines)) <= 100, max(lines, key=len)
    assert any("GQA instead of MLA" in line for line in lines)  # the longest description, wrapped not cut


def test_articles_and_plurals() -> None:
    from kforge_cli.settings.rules import _a

    assert [f"{_a(n)} {n}-node" for n in (1, 2, 8, 11, 16, 18, 80, 800, 11000)] == [
        "a 1-node",
        "a 2-node",
        "an 8-node",
        "an 11-node",
        "a 16-node",
        "an 18-node",
        "an 80-node",
        "an 800-node",
        "an 11000-node",
    ]


def test_training_complete_says_1_step(caplog: pytest.LogCaptureFixture) -> None:
    from kforge_cli.cli.outcome import exit_code
    from kforge_cli.engine.train.loop import TrainOutcome

    with caplog.at_level(logging.INFO, logger="kforge"):
        exit_code(TrainOutcome(status="completed", step=1, run_dir=Path("r"), last_loss=2.0, last_eval_loss=None))
    assert "training complete: 1 step, final loss 2.0000" in caplog.text


def test_integer_settings_refuse_quoted_and_decimal_values_but_env_text_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kforge_cli.errors import ConfigError
    from kforge_cli.settings import load_settings

    config = tmp_path / "c.toml"
    config.write_text('[train]\nmax_steps = "100"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(config=config, use_env=False)
    assert [i.path for i in err.value.issues] == ["train.max_steps"]
    assert "not the string '100': write it without quotes" in str(err.value) and str(config) in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=["--train.batch_size=8.0"], use_env=False)
    assert "train.batch_size" in str(err.value) and "not the float 8.0" in str(err.value)
    with pytest.raises(ConfigError):
        load_settings(overrides=["--train.data_seed=3.0"], use_env=False)  # int | None too
    assert (
        load_settings(overrides=["--optimizer.lr=1", "--train.data_seed=3"], use_env=False).settings.optimizer.lr == 1.0
    )
    monkeypatch.setenv("KFORGE_TRAIN__MAX_STEPS", "100")  # environment variables are text: parsed
    assert load_settings().settings.train.max_steps == 100


def test_tensorboard_tags_are_grouped() -> None:
    from kforge_cli.engine.observe.tensorboard_backend import tensorboard_tag

    tags = {
        k: tensorboard_tag(k)
        for k in (
            "loss",
            "lr",
            "grad_norm",
            "tokens_seen",
            "loss/web",
            "tokens/web",
            "eval_loss",
            "tokens_per_sec",
            "mfu",
            "peak_rss_gib",
            "checkpoint_step",
            "checkpoint/bytes",
            "eval/heldout/loss",
        )
    }
    assert tags == {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_seen": "train/tokens_seen",
        "loss/web": "train/loss/web",
        "tokens/web": "train/tokens/web",
        "eval_loss": "eval/loss",
        "tokens_per_sec": "perf/tokens_per_sec",
        "mfu": "perf/mfu",
        "peak_rss_gib": "memory/peak_rss_gib",
        "checkpoint_step": "checkpoint/step",
        "checkpoint/bytes": "checkpoint/bytes",
        "eval/heldout/loss": "eval/heldout/loss",
    }


def test_the_resume_hint_carries_the_allow_hooks_the_run_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kforge_cli.cli.outcome import resume_hint

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert resume_hint(Path("/r/x")) == "continue with: kforge resume /r/x"
    hooks = ["my_pkg.hooks:Clock", "other:Log"]
    assert resume_hint(Path("/r/x"), hooks) == "continue with: kforge resume /r/x --allow-hooks=my_pkg.hooks,other"


def test_a_new_max_steps_on_a_continued_run_warns_when_it_reshapes_the_schedule() -> None:
    from kforge_cli.cli.resume import schedule_change_warning
    from kforge_cli.settings import JobSettings, load_settings

    def s(*overrides: str) -> JobSettings:
        return load_settings(overrides=list(overrides), use_env=False).settings

    message = schedule_change_warning(s("--train.max_steps=40"), s("--train.max_steps=80"))
    assert message is not None and "train.max_steps 40 -> 80 reshapes the cosine" in message
    assert "scheduler.decay_steps" in message
    assert schedule_change_warning(s("--train.max_steps=40"), s("--train.max_steps=40")) is None
    fixed = ["--scheduler.decay_steps=30"]
    assert schedule_change_warning(s("--train.max_steps=40", *fixed), s("--train.max_steps=80", *fixed)) is None
    const = ["--scheduler.name=constant"]
    assert schedule_change_warning(s("--train.max_steps=40", *const), s("--train.max_steps=80", *const)) is None
    wsd = ["--scheduler.name=wsd", "--scheduler.decay_steps=10"]
    message = schedule_change_warning(s("--train.max_steps=40", *wsd), s("--train.max_steps=80", *wsd))
    assert message is not None and "wsd" in message and "decay_steps" not in message
