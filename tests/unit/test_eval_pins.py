"""``eval.after_checkpoint``'s files: the pin retention honours (and a dead holder's pin that it does not),
the status a reader counts, the consent task code needs, the tracker's per-backend write."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.checkpoints import prune
from kforge_cli.rundir.eval_records import (
    PIN_MAX_AGE_S,
    effective_state,
    eval_counts,
    pin_holds,
    write_pin,
    write_status,
)
from kforge_cli.rundir.names import EVAL_PIN_FILE
from kforge_cli.settings import load_settings
from tests.unit.test_checkpoint_layout import fake_checkpoint


@pytest.fixture
def live_pid() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its pid names no process
    return proc.pid


def test_retention_keeps_a_checkpoint_a_live_evaluation_pins_and_not_a_dead_ones(
    tmp_path: Path, live_pid: subprocess.Popen[bytes]
) -> None:
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    write_pin(tmp_path / "step_1", live_pid.pid)
    write_pin(tmp_path / "step_2", _dead_pid())  # a killed evaluation's pin
    deleted = prune(tmp_path, keep_last_n=1, protect=set())
    assert sorted(p.name for p in deleted) == ["step_2", "step_3"]
    assert (tmp_path / "step_1").is_dir()
    live_pid.kill()
    live_pid.wait()
    assert [p.name for p in prune(tmp_path, keep_last_n=1, protect=set())] == ["step_1"]  # the holder ended


def test_a_pin_from_another_host_holds_for_a_day_at_most(tmp_path: Path) -> None:
    step = fake_checkpoint(tmp_path, 5)
    now = time.time()
    (step / EVAL_PIN_FILE).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "time": now - 60}))
    assert pin_holds(step, now)
    assert not pin_holds(step, now + PIN_MAX_AGE_S)
    (step / EVAL_PIN_FILE).write_text("{not json")
    assert not pin_holds(step)  # not a pin kforge wrote


def test_a_running_evaluation_whose_process_is_gone_counts_as_failed(
    tmp_path: Path, live_pid: subprocess.Popen[bytes]
) -> None:
    from kforge_cli.rundir.eval_records import this_host

    host = this_host()
    write_status(tmp_path, 2, {"state": "running", "pid": live_pid.pid, "host": host})
    write_status(tmp_path, 4, {"state": "running", "pid": _dead_pid(), "host": host})  # SIGKILLed
    write_status(tmp_path, 6, {"state": "running", "pid": None, "launched_by": _dead_pid(), "host": host})
    write_status(tmp_path, 8, {"state": "done", "results": {}})
    write_status(tmp_path, 10, {"state": "failed", "error": "x"})
    write_status(tmp_path, 12, {"state": "running", "pid": 1, "host": "node-elsewhere"})
    assert effective_state({"state": "running", "pid": _dead_pid(), "host": host}) == "failed"
    counts = eval_counts(tmp_path)
    assert (counts.done, counts.running, counts.failed) == (1, 2, 3)
    assert counts.cell() == "1/2/3"


def test_task_code_in_after_checkpoint_tasks_needs_allow_hooks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.engine.evaluation.after_checkpoint import eval_command
    from kforge_cli.settings.task_code import consented_code, refuse_unallowed_eval_code

    task = tmp_path / "mine.yaml"
    task.write_text("task: mine\ndataset_path: json\nprocess_docs: !function my_utils.process\n")
    settings = load_settings(
        overrides=["--eval.after_checkpoint=true", f'--eval.after_checkpoint_tasks=["heldout", "lm-eval:{task}"]'],
        use_env=False,
    ).settings
    with pytest.raises(InvalidInputError, match=r"eval.after_checkpoint_tasks: kforge train: .*--allow-hooks=my_utils"):
        refuse_unallowed_eval_code(settings, None, "kforge train")
    refuse_unallowed_eval_code(settings, ["my_utils"], "kforge train")
    cmd = eval_command(settings, tmp_path / "checkpoints" / "step_2")
    assert cmd[-1] == "--allow-hooks=my_utils" and "--after-checkpoint" in cmd
    assert cmd[cmd.index("--max-batches") + 1] == str(settings.eval.steps)
    assert consented_code(settings) == ["my_utils"]  # what the job script and resume lines pass on
    typed = ["--eval.after_checkpoint=true", f'--eval.after_checkpoint_tasks=["lm-eval:{task}"]']
    with pytest.raises(SystemExit) as exited:  # `kforge train` in this process
        main(["train", *typed, f"--train.run_dir={tmp_path / 'run'}", "--train.max_steps=1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--allow-hooks=my_utils" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_the_tracker_writes_a_record_to_the_backends_named_only(tmp_path: Path) -> None:
    from kforge_cli.engine.observe.metrics_file import MetricsFile, read_metrics
    from kforge_cli.engine.observe.tracker import Tracker
    from tests.unit.test_tracker import FakeBackend

    backend = FakeBackend()
    tracker = Tracker(MetricsFile(tmp_path / "metrics.jsonl"), [backend])
    tracker.start()
    tracker.write({"step": 4, "eval/heldout/loss": 2.5}, only=("jsonl",))
    tracker.write({"step": 9, "eval/heldout/loss": 2.5}, only=("fake",))
    tracker.close("completed")
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [4]
    assert [step for step, _ in backend.delivered()] == [9]
    sent = Tracker(None, [backend2 := FakeBackend()])  # no file: the backends only
    sent.write({"step": 1, "x": 1.0})
    sent.close("completed")
    assert backend2.delivered() == [(1, {"x": 1.0})]


def test_settings_refuse_an_evaluation_per_checkpoint_that_cannot_work() -> None:
    from kforge_cli.errors import ConfigError

    typed = ["--eval.after_checkpoint=true", "--checkpoint.dir=/elsewhere", "--eval.after_checkpoint_tasks=[]"]
    with pytest.raises(ConfigError) as refused:
        load_settings(overrides=typed, use_env=False)
    assert [i.path for i in refused.value.issues] == ["eval.after_checkpoint", "eval.after_checkpoint_tasks"]
    load_settings(overrides=["--eval.after_checkpoint=true"], use_env=False)  # the default tasks: fine


def test_an_evaluation_log_planted_as_a_link_is_never_written_through(tmp_path: Path) -> None:
    """The evaluation process's log in RUN_DIR/eval is opened without following a link (exit 2, not a write)."""
    from kforge_cli.common.files import SymlinkRefusedError
    from kforge_cli.engine.evaluation.after_checkpoint import _popen

    outside = tmp_path / "outside.txt"
    outside.write_text("")
    log = tmp_path / "step_2.log"
    log.symlink_to(outside)
    with pytest.raises(SymlinkRefusedError):
        _popen([sys.executable, "-c", "print('written')"], log, {})
    time.sleep(0.2)
    assert outside.read_text() == ""
