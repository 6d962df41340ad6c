"""TensorBoard tracking for real: a SIGTERMed and requeued `kforge train` is one run in the event files.

The event files are read back with TensorBoard's own ``EventAccumulator``, which applies
the requeued writer's ``purge_step``: each step must appear exactly once, with the value
metrics.jsonl holds last for it (the job that went on).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kforge_cli.engine.observe.tensorboard_backend import tensorboard_tag
from tests.conftest import REPO
from tests.e2e.test_tracking_hooks import HOOKS, TINY, hook_env, numeric_metrics
from tests.e2e.test_tracking_mlflow import read_jsonl

pytestmark = pytest.mark.e2e
pytest.importorskip("tensorboard")


def test_preempted_and_requeued_job_is_one_tensorboard_run(kforge, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    n = 4
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--run-dir",
        str(run_dir),
        f"--train.max_steps={2 * n}",
        "--eval.interval=3",
        "--eval.steps=2",
        "--checkpoint.interval=3",
        f'--train.hooks=["{HOOKS}:SigtermAt"]',
        '--metrics.backends=["jsonl","tensorboard"]',
        *TINY,
    ]
    first = kforge(*args, cwd=REPO, env=hook_env(KFORGE_TEST_SIGTERM_AT=str(n)))
    assert first.returncode == 75, first.stderr[-3000:]
    second = kforge(*args, cwd=REPO, env=hook_env())
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per job, one dir

    expected: dict[str, dict[int, float]] = {}
    for rec in read_jsonl(run_dir):
        for key, value in numeric_metrics(rec).items():
            expected.setdefault(key, {})[rec["step"]] = value
    assert sorted(expected["loss"]) == list(range(1, 2 * n + 1))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/lr", "train/grad_norm", "checkpoint/step"} <= tags  # grouped
    assert {tag.split("/", 1)[0] for tag in tags} <= {"train", "eval", "perf", "memory", "checkpoint"}, tags
    for key, by_step in expected.items():
        scalars = events.Scalars(tensorboard_tag(key))
        assert [s.step for s in scalars] == sorted(by_step), key  # every step once: the redone step 4 purged
        for s in scalars:
            assert s.value == pytest.approx(by_step[s.step], rel=1e-6), (key, s.step)  # stored as float32
