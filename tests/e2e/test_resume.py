"""Resume for real: SIGTERM then `kforge resume`, kill -9 during saves, hostile checkpoints, shape refusals."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.engine.checkpoint import newest_complete, read_latest, resolve_checkpoint
from kforge_cli.engine.train.hooks import TrainHook
from tests.helpers import tiny
from tests.helpers.launch import STDOUT, Proc, start_kforge, with_repo_path
from tests.helpers.metrics import step_losses as losses

pytestmark = pytest.mark.e2e

# A small learnable job (built-in corpus), one log record per step, no eval, saves only where asked.
ARGS = [
    *tiny.model(64, 2, 4, 2),
    "--train.seq_len=64",
    "--train.batch_size=8",
    "--scheduler.warmup_steps=2",
    *tiny.QUIET,
    "--checkpoint.interval=0",
]
HOOK = '--train.hooks=["tests.e2e.test_resume:SigtermAt"]'
# `kforge train` on the stopped run keeps its settings unless typed: the relaunch types the hook away
NO_HOOK = "--train.hooks=[]"
ENV = with_repo_path(os.environ)


class SigtermAt(TrainHook):
    """Sends a real SIGTERM to its own process after step $KFORGE_TEST_SIGTERM_STEP (on rank $..._RANK only)."""

    def on_step_end(self, session: Any, info: Any) -> None:
        step = int(os.environ.get("KFORGE_TEST_SIGTERM_STEP", "-1"))
        rank = int(os.environ.get("KFORGE_TEST_SIGTERM_RANK", "0"))
        if info.step == step and session.runtime.rank == rank:
            os.kill(os.getpid(), signal.SIGTERM)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_record(run_dir: Path) -> dict[str, Any]:
    """The last step record (checkpoint records carry no loss)."""
    return [r for r in records(run_dir) if "loss" in r][-1]


def test_sigterm_at_n_then_resume_matches_uninterrupted_run_bit_for_bit(kforge, tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = kforge("train", "--run-dir", str(ref), *ARGS, "--train.max_steps=12", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    r = kforge(
        "train",
        "--run-dir",
        str(run),
        *ARGS,
        "--train.max_steps=12",
        HOOK,
        env={**ENV, "KFORGE_TEST_SIGTERM_STEP": "6"},
    )
    assert r.returncode == 75, r.stderr[-3000:]
    assert "stopped by SIGTERM at step 6 after saving a checkpoint" in r.stderr
    assert read_latest(run / "checkpoints") == run / "checkpoints" / "step_6" and max(losses(run)) == 6
    r = kforge("resume", str(run), "--allow-hooks=tests.e2e.test_resume", env=ENV)  # the saved config names it
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_6'} (step 6)" in r.stderr
    assert losses(run) == losses(ref) and len(losses(ref)) == 12  # same data, same RNG, same loss curve
    assert last_record(run)["tokens_seen"] == last_record(ref)["tokens_seen"] == 12 * 8 * 64
    assert read_latest(run / "checkpoints") == run / "checkpoints" / "step_12"  # the final save
    saves = {r["step"]: r for r in records(run) if "checkpoint/bytes" in r}  # one record per save
    assert 6 in saves and 12 in saves and all(r["checkpoint/bytes"] > 0 for r in saves.values())
    assert all(0 <= r["checkpoint/blocked_s"] <= r["checkpoint/seconds"] for r in saves.values())
    r = kforge("resume", str(run), "--model.dim=32", "--train.max_steps=20", env=ENV)
    assert r.returncode == 2 and "model.dim: 64 -> 32" in r.stderr and "Traceback" not in r.stderr


def _start(run: Path, args: list[str], log: Path) -> Proc | subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return start_kforge(["train", "--run-dir", str(run), *args], stdout=f, stderr=STDOUT, env={**os.environ, **ENV})


def _kill_during_save(proc: Proc | subprocess.Popen[bytes], root: Path, min_step: int, deadline: float) -> None:
    """SIGKILL as soon as this process has a save past `min_step` in progress (a step dir it created that has
    no commit marker yet), once an earlier checkpoint is complete."""
    started = time.time()
    while time.monotonic() < deadline and proc.poll() is None:
        for d in root.glob("step_*"):
            try:
                fresh = d.stat().st_mtime >= started and int(d.name[5:]) > min_step
            except FileNotFoundError:  # deleted by retention meanwhile
                continue
            if fresh and not (d / "kforge_commit.json").exists() and newest_complete(root)[0] is not None:
                proc.kill()
                return
        time.sleep(0.002)
    proc.kill()


def _records(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill_after_progress(proc: Proc | subprocess.Popen[bytes], run: Path, delay: float, deadline: float) -> None:
    """SIGKILL `delay` seconds after this process logged its first step."""
    before = _records(run)
    while time.monotonic() < deadline and proc.poll() is None:
        if _records(run) > before:
            time.sleep(delay)
            break
        time.sleep(0.01)
    proc.kill()


def test_kill_9_at_random_moments_always_resumes_from_a_complete_checkpoint(kforge, tmp_path: Path) -> None:
    args = [
        *ARGS,
        "--train.max_steps=16",
        "--checkpoint.interval=1",
        "--checkpoint.keep_last_n=2",
        "--checkpoint.async_mode=async",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = kforge("train", "--run-dir", str(ref), *args, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    root, rng, expected = run / "checkpoints", random.Random(6), None
    for trial in range(3):
        log = tmp_path / f"trial{trial}.log"
        proc = _start(run, args, log)
        start_step = int(expected.name[5:]) if expected else 0
        deadline = time.monotonic() + 180
        if trial == 1:
            _kill_after_progress(proc, run, rng.uniform(0.0, 0.5), deadline)
        else:
            _kill_during_save(proc, root, start_step, deadline)
        assert proc.wait(timeout=60) == -signal.SIGKILL, log.read_text()[-2000:]
        text = log.read_text()
        if expected is not None:
            assert f"resumed from {expected} (step {expected.name[5:]})" in text, text[-2000:]
        expected, _ = newest_complete(root)
        assert expected is not None and resolve_checkpoint(run) == expected  # a complete one is always there
    r = kforge("train", "--run-dir", str(run), *args, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {expected} (step {expected.name[5:]})" in r.stderr
    assert losses(run) == losses(ref)  # every step, including the final loss, as if never killed


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_hostile_checkpoints_are_refused_by_resume_and_warm_start(kforge, tmp_path: Path) -> None:
    good = tmp_path / "good"
    r = kforge("train", "--run-dir", str(good), *ARGS, "--train.max_steps=2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    marker = tmp_path / "pwned"
    meta_run, state_run = tmp_path / "meta", tmp_path / "state"
    shutil.copytree(good, meta_run)
    shutil.copytree(good, state_run)
    (meta_run / "checkpoints" / "step_2" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    torch.save({"torch_cpu": Payload(marker)}, state_run / "checkpoints" / "step_2" / "train_state" / "rank_0.pt")
    step = Path("checkpoints") / "step_2"
    attempts = {  # what -> (arguments, the file the error must name)
        "resume, .metadata": (["--run-dir", str(meta_run)], meta_run / step / ".metadata"),
        "resume, train state": (["--run-dir", str(state_run)], state_run / step / "train_state" / "rank_0.pt"),
        "warm start, .metadata": (
            ["--run-dir", str(tmp_path / "fresh"), f"--checkpoint.init_from={meta_run}"],
            meta_run / step / ".metadata",
        ),
    }
    for what, (extra, bad_file) in attempts.items():
        r = kforge("train", *extra, *ARGS, "--train.max_steps=4", env=ENV)
        assert r.returncode == 2, (what, r.stderr[-2000:])
        assert f"refusing to open {bad_file}" in r.stderr or f"refusing to load {bad_file}" in r.stderr, r.stderr
        assert "code" in r.stderr and "Traceback" not in r.stderr, what
    assert not marker.exists()
