"""A second command on an existing run never damages it (issue 30, item 1).

The repro: `kforge train --data.path=D --train.max_steps=2 --run-dir R`, then `kforge train
--run-dir R --train.max_steps=4`. The second command used to rewrite R/config.toml with the
defaults before checking anything, then fail on the data order, and from then on `kforge
resume R` failed the same way. Now it is refused before a file is touched, names the run's
data path and the fix, and the run still resumes. The general rule: any refused command
(train, resume, export-hf, eval, with or without --sbatch) leaves every file of the run
byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from tests.conftest import REPO

pytestmark = pytest.mark.e2e

TINY = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=64",
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--train.num_threads=1",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=0",
]
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def snapshot(run: Path) -> dict[str, str]:
    """Every file and folder under `run` (links included) -> the SHA-256 of its bytes ('dir' for a folder)."""
    out = {}
    for path in sorted(run.rglob("*")):
        rel = str(path.relative_to(run))
        if path.is_symlink():
            out[rel] = "link:" + str(path.readlink())
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def prepare(root: Path) -> Path:
    text = root / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    out = root / "byte"
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare-data", str(text), "--out", str(out), "--quiet", "--workers", "1"])
    assert exit_info.value.code == 0
    return out


def test_the_data_loss_repro_is_refused_byte_identical_and_the_run_still_resumes(kforge, tmp_path: Path) -> None:
    data, run = prepare(tmp_path), tmp_path / "runs" / "repro"
    r = kforge("train", f"--data.path={data}", "--train.max_steps=2", "--run-dir", str(run), *TINY, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    before = snapshot(run)
    r = kforge("train", "--run-dir", str(run), "--train.max_steps=4", env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"data.path: '{data}' -> None (the run has '{data}'" in r.stderr  # the original value, named
    assert (
        f"fix: continue the run with its own settings and your overrides: kforge resume {run} --train.max_steps=4"
        in (r.stderr)
    )
    assert snapshot(run) == before  # not one byte of the run changed
    r = kforge("resume", str(run), "--train.max_steps=4", env=ENV)  # the fix, as printed
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_2'} (step 2)" in r.stderr
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3, 4]
    assert (run / "config.toml").read_bytes() == _bytes(before, run, "config.toml")  # written once
    [change] = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert change["changes"] == {"train.max_steps": {"from": 2, "to": 4}}
    assert change["command"].startswith(f"kforge resume {run} --train.max_steps=4")


def _bytes(snap: dict[str, str], run: Path, name: str) -> bytes:
    data = (run / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == snap[name]
    return data


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 2-step run on a prepared directory, with its final checkpoint."""
    from kforge_cli.engine.train import run_training
    from kforge_cli.settings import load_settings

    root = tmp_path_factory.mktemp("second")
    data, run = prepare(root), root / "run"
    overrides = [*TINY, f"--data.path={data}", "--train.max_steps=2", f"--train.run_dir={run}"]
    assert run_training(load_settings(overrides=overrides, use_env=False).settings).status == "completed"
    return run


SAME = [*TINY, "--data.path={data}", "--train.max_steps=2"]  # what started the run
REFUSED = {  # command -> what the refusal must say
    "train, a shape change": (["train", "--run-dir", "{run}", *SAME, "--model.dim=64"], "model.dim: 32 -> 64"),
    "train, the data order": (["train", "--run-dir", "{run}", *SAME, "--train.seq_len=16"], "train.seq_len: 32 -> 16"),
    "train, untyped defaults": (["train", "--run-dir", "{run}", "--train.max_steps=4"], "data.path:"),
    "train, another profile": (["train", "--run-dir", "{run}", "-p", "cpu-debug"], "not typed"),
    "train, a bad value": (["train", "--run-dir", "{run}", "--train.max_steps=abc"], "train.max_steps"),
    "train --sbatch, a shape change": (
        ["train", "--sbatch", "--run-dir", "{run}", *SAME, "--model.n_layers=1"],
        "model.n_layers: 2 -> 1",
    ),
    "resume, a shape change": (["resume", "{run}", "--model.n_heads=2"], "model.n_heads: 4 -> 2"),
    "resume, the data order": (["resume", "{run}", "--train.seed=7"], "train.seed: 42 -> 7"),
    "resume, an unknown key": (["resume", "{run}", "--train.max_step=4"], "did you mean train.max_steps"),
    "resume --sbatch, the data": (["resume", "{run}", "--sbatch", "--data.path=/nonexistent"], "data.path"),
    "export-hf into the run": (["export-hf", "{run}", "{run}"], "holds the checkpoint being exported"),
    "export-hf, a bad dtype": (["export-hf", "{run}", "{out}", "--dtype=fp8"], "fp8"),
    "eval, an unknown task": (["eval", "{run}", "--task", "nosuch"], "unknown task 'nosuch'"),
    "eval, a missing tokenizer": (
        ["eval", "{run}", "--task", "heldout", "--tokenizer", "/nonexistent.json"],
        "does not exist",
    ),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_a_refused_command_leaves_every_file_of_the_run_byte_identical(
    what: str, trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, message = REFUSED[what]
    argv = [a.format(run=trained, out=tmp_path / "hf", data=trained.parent / "byte") for a in argv]
    before = snapshot(trained)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err, err
    assert snapshot(trained) == before, what
    assert not (tmp_path / "hf").exists()


def test_eval_without_a_task_scores_heldout(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41: `kforge eval RUN` without --task failed; it scores the held-out loss."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(trained), "--max-batches", "1"])
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None) and "heldout" in out, out
