"""``eval.after_checkpoint``: every committed checkpoint is evaluated by a real `kforge eval` process
of its own while training goes on.

One tiny run through the real loop (built-in byte corpus, 10 steps, an async checkpoint every 2
steps, ``keep_last_n=1``) starts five evaluations; a hook SIGKILLs the first one. Asserted: the
four others write ``eval/step_N.json`` at their checkpoints' steps with the held-out loss that
`kforge eval` computes, each checkpoint survives retention while its evaluation reads it, the
killed one is reported (a warning, ``failed`` in its status, its pin gone) and training completes
regardless, without waiting for the evaluations; the loop's time spent on them is recorded and
small; `kforge runs` counts them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kforge_cli.engine.train.session import StepInfo, TrainHook, TrainingSession
from kforge_cli.rundir.eval_records import eval_counts, read_status
from kforge_cli.rundir.names import EVAL_PIN_FILE
from tests.helpers import tiny

STEPS = [2, 4, 6, 8, 10]
KILLED = 2
OVERRIDES = [
    *tiny.model(32, 2, 4, max_seq_len=64),
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--train.max_steps=10",
    "--scheduler.warmup_steps=1",
    *tiny.QUIET,
    "--eval.steps=2",
    "--eval.batch_size=2",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last_n=1",
    "--checkpoint.async_mode=async",
    "--eval.after_checkpoint=true",
]


class KillFirstEvaluation(TrainHook):
    """At step 6, SIGKILL the evaluation of step 2 (started a few steps ago, so still importing torch)."""

    def __init__(self) -> None:
        self.killed_pid: int | None = None

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None:
        if info.step != 6 or not session.runtime.is_main:
            return
        from kforge_cli.engine.train.components.eval_after_checkpoint import EvalAfterCheckpoint

        component = session.components.get(EvalAfterCheckpoint)
        assert component is not None and component.evals is not None
        evaluation = component.evals.evaluations[KILLED]
        deadline = time.monotonic() + 10
        while evaluation.proc is None:  # its start (a fork on a thread of its own) may still be on the way
            assert time.monotonic() < deadline, f"step 2's evaluation did not start ({evaluation.state})"
            time.sleep(0.01)
        assert evaluation.proc.poll() is None, "step 2's evaluation already ended"
        self.killed_pid = evaluation.proc.pid
        os.kill(self.killed_pid, signal.SIGKILL)
        while _state(self.killed_pid) != "Z":  # dead, not yet reaped (the component's next check reaps it)
            if time.monotonic() > deadline:  # pragma: no cover
                raise AssertionError("the killed evaluation did not die")
            time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kforge_cli.engine.train import run_training
    from kforge_cli.settings import load_settings

    out = tmp_path_factory.mktemp("evalckpt") / "run"
    settings = load_settings(overrides=[*OVERRIDES, f"--train.run_dir={out}"], use_env=False).settings
    hook = KillFirstEvaluation()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("kforge").addHandler(handler)
    t0 = time.perf_counter()
    try:
        outcome = run_training(settings, hooks=[hook])
    finally:
        logging.getLogger("kforge").removeHandler(handler)
    train_s = time.perf_counter() - t0
    at_end = {s: read_status(out, s) for s in STEPS}
    deadline = time.monotonic() + 90
    while any((read_status(out, s) or {}).get("state") == "running" for s in STEPS if s != KILLED):
        assert time.monotonic() < deadline, "evaluations did not finish"
        time.sleep(0.2)
    return {
        "run": out,
        "outcome": outcome,
        "hook": hook,
        "logs": [r.getMessage() for r in records],
        "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
        "train_s": train_s,
        "at_end": at_end,
    }


def test_every_committed_checkpoint_is_evaluated_at_its_step(trained: dict[str, Any]) -> None:
    run: Path = trained["run"]
    assert trained["outcome"].status == "completed"
    for step in STEPS[1:]:
        result = json.loads((run / "eval" / f"step_{step}.json").read_text())
        assert result["step"] == step
        heldout = result["tasks"]["heldout"]
        assert heldout["batches"] == 2 and 0 < heldout["loss"] < 10
        status: dict[str, Any] | None = read_status(run, step)
        assert status is not None and status["state"] == "done", status
        assert status["results"]["heldout"] == heldout
        assert not (run / "checkpoints" / f"step_{step}" / EVAL_PIN_FILE).exists()  # the evaluation let go
    losses = [json.loads((run / "eval" / f"step_{s}.json").read_text())["tasks"]["heldout"]["loss"] for s in STEPS[1:]]
    assert len(set(losses)) == len(losses)  # four checkpoints, four different models
    # keep_last_n=1 would have deleted them: each stayed while its evaluation read it
    assert any("keeping" in m and "step_4" in m for m in trained["logs"])


def test_the_result_is_kforge_evals(trained: dict[str, Any]) -> None:
    from kforge_cli.engine.evaluation.tasks import run_task
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference

    run: Path = trained["run"]
    loaded = open_for_inference(run / "checkpoints" / f"step_{STEPS[-1]}")
    expected = run_task(loaded, "heldout", max_batches=2)
    got = json.loads((run / "eval" / f"step_{STEPS[-1]}.json").read_text())["tasks"]["heldout"]
    assert got == pytest.approx(expected, rel=1e-6)


def test_a_killed_evaluation_is_reported_and_training_survives(trained: dict[str, Any]) -> None:
    run: Path = trained["run"]
    assert trained["hook"].killed_pid is not None
    status: dict[str, Any] | None = read_status(run, KILLED)
    assert status is not None and status["state"] == "failed" and "SIGKILL" in status["error"], status
    assert not (run / "eval" / f"step_{KILLED}.json").exists()
    assert any(f"checkpoint step {KILLED} failed (killed by SIGKILL)" in w for w in trained["warnings"])
    assert not (run / "checkpoints" / f"step_{KILLED}").exists()  # unpinned: retention took it later
    counts = eval_counts(run)
    assert (counts.done, counts.running, counts.failed) == (4, 0, 1)


def test_the_loop_barely_waits_and_does_not_wait_at_the_end(trained: dict[str, Any]) -> None:
    run: Path = trained["run"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    blocked = [r["eval_after_checkpoint/blocked_s"] for r in records if "eval_after_checkpoint/blocked_s" in r]
    total = blocked[-1]
    per_checkpoint = total / len(STEPS)
    print(f"\nloop blocked {total * 1e3:.1f} ms for {len(STEPS)} checkpoints ({per_checkpoint * 1e3:.1f} ms each)")
    assert per_checkpoint < 0.1, blocked
    final = trained["at_end"][STEPS[-1]]
    assert final is not None and final["state"] == "running"  # training ended before its last evaluation did
    ended: list[dict[str, Any]] = [read_status(run, s) or {} for s in STEPS[1:]]
    print(
        "evaluation processes: "
        + ", ".join(f"{e['ended'] - e['started']:.1f} s ({e['seconds']:.1f} s after the import)" for e in ended)
    )
    relayed = [r for r in records if "eval/heldout/loss" in r]  # those that finished before training did
    assert len({r["step"] for r in relayed}) == len(relayed)  # each once: the evaluations never append here
    for r in relayed:
        assert (
            r["eval/heldout/loss"]
            == json.loads((run / "eval" / f"step_{r['step']}.json").read_text())["tasks"]["heldout"]["loss"]
        )


def test_kforge_runs_counts_the_evaluations(trained: dict[str, Any]) -> None:
    from kforge_cli.cli.runs_table import describe_run

    row = describe_run(trained["run"])
    assert row.evals == "4/0/1"
