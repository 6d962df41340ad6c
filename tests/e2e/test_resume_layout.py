"""A resume keeps what the run was: its processes and its layout (issue 41).

A `kforge train --nproc-per-node 2 --distributed.tp=2` run stopped by Ctrl-C prints a command
that continues it (`kforge resume RUN --nproc-per-node 2`), and that command reproduces the
uninterrupted run step for step. A later `kforge train --run-dir RUN --nproc-per-node 2` that
does not type the layout would train it with tp=1: refused, not one byte of the run changed.
A typed change of the mesh is allowed, warned about and recorded.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
from pathlib import Path
from typing import Any

import pytest

from kforge_cli.engine.train.hooks import TrainHook
from tests.e2e.test_second_command import snapshot
from tests.helpers import tiny
from tests.helpers.launch import with_repo_path
from tests.helpers.metrics import step_losses

pytestmark = pytest.mark.e2e

ARGS = [
    *tiny.model(32, 2, 4, 2),
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--scheduler.warmup_steps=1",
    *tiny.QUIET,
    "--checkpoint.interval=0",
    "--distributed.tp=2",
    "--train.max_steps=8",
]
HOOK = '--train.hooks=["tests.e2e.test_resume_layout:CtrlCAt"]'
ENV = {**with_repo_path(os.environ), "OMP_NUM_THREADS": "1"}


class CtrlCAt(TrainHook):
    """Rank 0 presses Ctrl-C after step $KFORGE_TEST_CTRL_C_STEP: SIGINT to its launcher, which
    forwards it to every rank (as a terminal's Ctrl-C reaches `kforge train --nproc-per-node`)."""

    def on_step_end(self, session: Any, info: Any) -> None:
        if info.step == int(os.environ.get("KFORGE_TEST_CTRL_C_STEP", "-1")) and session.runtime.rank == 0:
            os.kill(os.getppid(), signal.SIGINT)


def test_a_tp2_run_stopped_by_ctrl_c_resumes_with_the_printed_command_and_keeps_its_layout(
    kforge, tmp_path: Path
) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = kforge("train", "--nproc-per-node", "2", "--run-dir", str(ref), *ARGS, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DTensor random" not in r.stderr and "is deprecated" not in r.stderr, r.stderr[-3000:]  # torch's noise
    r = kforge(
        "train",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(run),
        *ARGS,
        HOOK,
        env={**ENV, "KFORGE_TEST_CTRL_C_STEP": "3"},
    )
    assert r.returncode == 75, r.stderr[-3000:]
    [hint] = [line for line in r.stderr.splitlines() if "continue with: " in line]  # printed once, not per rank
    command = hint.split("continue with: ", 1)[1]
    allow = "--allow-hooks=tests.e2e.test_resume_layout"
    assert command == f"kforge resume {run} {allow} --nproc-per-node 2", hint
    stopped = max(step_losses(run))
    assert 3 <= stopped < 8
    launch = json.loads((run / "launch.json").read_text())
    assert (launch["launcher"], launch["nproc_per_node"], launch["mesh"]["tp"]) == ("local", 2, 2)

    # The layout would change (tp 2 -> the default 1) without the command typing it: refused, nothing written.
    before = snapshot(run)
    r = kforge("train", "--run-dir", str(run), "--nproc-per-node", "2", "--train.max_steps=8", allow, env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "distributed.tp: 2 -> 1 (the run has 2; this value comes from" in r.stderr, r.stderr[-3000:]
    assert snapshot(run) == before

    r = kforge(*shlex.split(command)[1:], env=ENV)  # the printed command, as printed
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped}'} (step {stopped})" in r.stderr
    assert "another device mesh" not in r.stderr
    assert step_losses(run) == step_losses(ref) and len(step_losses(ref)) == 8  # per step, bit for bit

    # A typed change of the mesh is allowed: a WARNING, and a record beside config.toml.
    r = kforge("resume", str(run), allow, "--nproc-per-node", "1", "--distributed.tp=1", "--train.max_steps=9", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WARNING" in r.stderr and "on another device mesh: 2 processes (tp=2) -> 1 process (no parallelism)" in (
        r.stderr
    ), r.stderr[-3000:]
    records = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert records[-1]["layout"] == {"from": "2 processes (tp=2)", "to": "1 process (no parallelism)"}
    assert records[-2]["changes"] == {
        "distributed.tp": {"from": 2, "to": 1},
        "train.max_steps": {"from": 8, "to": 9},
    }
