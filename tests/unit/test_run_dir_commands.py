"""`kforge runs` and `kforge resume` without torch; `kforge runs` for SLURM jobs and its number formats.

A run directory's rules live in `kforge_cli.rundir` (no torch, no engine), so listing runs and
checking a resume (refusing it, finding nothing to do, writing its job) never wait for torch.
SLURM is faked by `squeue`/`sacct` scripts on PATH that print what the real ones would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from kforge_cli.cli.runs_table import list_runs
from kforge_cli.rundir.names import COMMIT_FILE, DCP_METADATA, SUMMARY_FILE
from kforge_cli.settings import load_settings
from kforge_cli.settings.explain import to_toml


def make_run(root: Path, name: str, *, steps: int = 0, planned: int = 4, reason: str | None = None) -> Path:
    """A run as kforge leaves it: config.toml, `steps` logged steps, and a checkpoint saved for `reason`."""
    run = root / name
    (run / "logs").mkdir(parents=True)
    settings = load_settings(overrides=[f"--train.run_dir={run}", f"--train.max_steps={planned}"], use_env=False)
    (run / "config.toml").write_text(to_toml(settings.settings))
    if steps:
        records = [{"step": s, "loss": 10.0 / s, "tokens_seen": 64 * s} for s in range(1, steps + 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if reason is not None:
        step_dir = run / "checkpoints" / f"step_{steps}"
        step_dir.mkdir(parents=True)
        (step_dir / DCP_METADATA).write_bytes(b"")
        (step_dir / COMMIT_FILE).write_text(json.dumps({"step": steps, "dcp_dirs": ["."]}))
        (step_dir / SUMMARY_FILE).write_text(json.dumps({"step": steps, "reason": reason}))
    return run


def age(run: Path, seconds: float = 3600) -> None:
    """Make every file of `run` `seconds` old (no longer 'running')."""
    old = time.time() - seconds
    for path in [run, *run.rglob("*")]:
        os.utime(path, (old, old))


def cli_modules(argv: list[str], cwd: Path) -> tuple[int, list[str], str]:
    """Run the CLI in a fresh interpreter; (exit code, heavy modules it imported, stderr)."""
    code = textwrap.dedent(f"""
        import sys
        from kforge_cli.cli.app import main
        try:
            main({argv!r})
            rc = 0
        except SystemExit as exc:
            rc = exc.code or 0
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') or m.startswith('kforge_cli.engine'))
        print('RESULT=' + str(rc) + ' ' + ','.join(heavy))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT="))
    rc, _, heavy = line.removeprefix("RESULT=").partition(" ")
    return int(rc), [m for m in heavy.split(",") if m], proc.stderr


def test_runs_and_resume_import_no_torch_and_no_engine(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    done = make_run(root, "done", steps=4, planned=4, reason="final")
    part = make_run(root, "part", steps=2, planned=4, reason="signal")
    age(done), age(part)
    cases = {
        "runs": (["runs", str(root)], 0, ""),
        "resume, nothing to do": (["resume", str(done)], 0, "nothing to do"),
        "resume, a shape change": (["resume", str(part), "--model.dim=64"], 2, "model.dim: 128 -> 64"),
        "resume --sbatch": (["resume", str(part), "--sbatch", "--train.max_steps=8"], 0, "submit with: sbatch"),
        "train --run-dir --sbatch": (["train", "--run-dir", str(part), "--sbatch"], 0, "submit with: sbatch"),
    }
    for what, (argv, expected_rc, message) in cases.items():
        rc, heavy, err = cli_modules(argv, tmp_path)
        assert (rc, heavy) == (expected_rc, []), (what, heavy, err[-2000:])
        assert message in err, (what, err[-2000:])
    [change] = [json.loads(x) for x in (part / "config_changes.jsonl").read_text().splitlines()]
    assert change["changes"] == {"train.max_steps": {"from": 4, "to": 8}}


def test_in_use_and_already_completed_are_refused_before_torch_loads(tmp_path: Path) -> None:
    """Issue 41: a second `train` on a live run waited 20 s for torch before "in use"; `train` on a
    finished run loaded torch, printed the banner and appended a record to do nothing."""
    from kforge_cli.rundir.lock import acquire_run_lock

    root = tmp_path / "runs"
    done = make_run(root, "done", steps=4, planned=4, reason="final")
    live = make_run(root, "live", steps=2, planned=8, reason="signal")
    starting = root / "starting"
    starting.mkdir()
    age(done)
    done_before = {p: p.read_bytes() for p in done.rglob("*") if p.is_file()}
    cases = {
        "train, already completed": (["train", "--run-dir", str(done)], 0, f"{done} already completed 4/4 steps"),
        "resume, already completed": (["resume", str(done)], 0, f"to train longer: kforge resume {done} --train"),
        "train, in use": (["train", "--run-dir", str(live)], 2, f"{live} is in use by another kforge run (pid"),
        "resume, in use": (["resume", str(live), "--train.max_steps=9"], 2, "is in use by another kforge run"),
        "train, a run starting": (["train", "--run-dir", str(starting)], 2, f"{starting} is in use"),
        "train --nproc-per-node, in use": (["train", "--run-dir", str(live), "--nproc-per-node", "2"], 2, "in use"),
    }
    locks = [acquire_run_lock(live, wait_s=0), acquire_run_lock(starting, wait_s=0)]
    try:
        for what, (argv, expected_rc, message) in cases.items():
            rc, heavy, err = cli_modules(argv, tmp_path)
            assert (rc, heavy) == (expected_rc, []), (what, heavy, err[-2000:])
            assert message in err and "loading PyTorch" not in err and "Traceback" not in err, (what, err[-2000:])
    finally:
        for lock in locks:
            lock.release()
    assert {p: p.read_bytes() for p in done.rglob("*") if p.is_file()} == done_before  # no record appended
    assert not (live / "config_changes.jsonl").exists()


def fake_slurm(bin_dir: Path, squeue: str | None, sacct: str | None) -> None:
    """`squeue`/`sacct` on PATH that print the given lines (None: the command does not exist)."""
    bin_dir.mkdir(exist_ok=True)
    for name, out in (("squeue", squeue), ("sacct", sacct)):
        if out is not None:
            script = bin_dir / name
            lines = " ".join(f"'{line}'" for line in out.splitlines())
            script.write_text(f"#!/bin/sh\nprintf '%s\\n' {lines}\n")  # a builtin: PATH holds only these
            script.chmod(0o755)


def test_sbatch_runs_show_their_slurm_state_never_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs"
    runs = {}
    for name in ("never", "queued", "by_hand", "cancelled", "lost"):
        runs[name] = make_run(root, name, planned=50000)
        (runs[name] / "job.sbatch").write_text("#!/bin/bash\n")
    for name, job in (("queued", "101"), ("cancelled", "102"), ("lost", "103")):
        (runs[name] / "slurm_jobs.jsonl").write_text(json.dumps({"job_id": job}) + "\n")
    local = make_run(root, "local", steps=3, planned=50000)  # a plain run that ended early
    for run in [*runs.values(), local]:
        age(run)
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", str(bin_dir))
    fake_slurm(
        bin_dir,
        squeue=f"101|PENDING|{runs['queued'] / 'job.sbatch'}\n104|PENDING|{runs['by_hand'].resolve() / 'job.sbatch'}",
        sacct="102|CANCELLED by 1000",
    )
    status = {r.name: (r.status, r.slurm_job) for r in list_runs(root)}
    assert status == {
        "never": ("not submitted", None),
        "queued": ("queued", "101"),
        "by_hand": ("queued", "104"),  # `sbatch RUN/job.sbatch` typed by hand: squeue knows it by its script
        "cancelled": ("cancelled", "102"),
        "lost": ("unknown", "103"),  # sacct knows nothing of it: not a guess
        "local": ("failed", None),
    }
    (bin_dir / "squeue").unlink()
    (bin_dir / "sacct").unlink()  # no SLURM here at all
    status = {r.name: r.status for r in list_runs(root)}
    assert status == {
        "never": "not submitted",
        "queued": "unknown",
        "by_hand": "not submitted",
        "cancelled": "unknown",
        "lost": "unknown",
        "local": "failed",
    }
    with pytest.raises(SystemExit) as exit_info:
        main(["runs", str(root)])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "name",
        "profile",
        "steps",
        "loss",
        "eval_loss",
        "checkpoint",
        "status",
        "updated",
        "job",
    ]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert by_name["never"].split()[:3] == ["never", "cpu-debug", "0/50,000"]
    assert by_name["local"].split()[:4] == ["local", "cpu-debug", "3/50,000", "3.3333"]
    assert "not submitted" in by_name["never"] and "failed" not in by_name["never"]


def test_runs_table_numbers_share_one_format_and_read_the_metrics_tail(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    long = make_run(root, "long", planned=200000)
    records = [{"step": s, "loss": 2.0 + 1.0 / s} for s in range(1, 120001)]
    records.insert(1000, {"step": 1000, "eval_loss": 2.5})  # the only eval, far from the end
    (long / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    short = make_run(root, "short", steps=2, planned=4)
    (short / "metrics.jsonl").write_text((short / "metrics.jsonl").read_text() + '{"step": 2, "eval_loss": 12.0}\n')
    age(long), age(short)
    rows = {r.name: r for r in list_runs(root)}
    assert (rows["long"].steps_done, rows["long"].last_loss) == (120000, pytest.approx(2.0 + 1 / 120000))
    assert rows["long"].eval_loss == 2.5  # found by reading backwards past 119,000 records
    assert rows["short"].eval_loss == 12.0
    from kforge_cli.cli.runs import _cells

    cells = {name: _cells(row, with_job=False) for name, row in rows.items()}
    assert cells["long"][2:5] == ("120,000/200,000", "2.0000", "2.5000")
    assert cells["short"][2:5] == ("2/4", "5.0000", "12.0000")


def test_train_on_an_existing_run_refuses_every_untyped_change_and_records_the_typed_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"

    def cli(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--sbatch", "--run-dir", str(run), *argv])
        return int(exit_info.value.code or 0), capsys.readouterr().err

    start = ["--optimizer.lr=1e-4", "--metrics.log_interval=1", "--checkpoint.interval=5"]
    assert cli(*start)[0] == 0
    original = (run / "config.toml").read_bytes()
    code, err = cli("--optimizer.lr=1e-4", "--train.max_steps=10")  # logging and cadence from the profile
    assert code == 2 and not (run / "config_changes.jsonl").exists()  # refused too (issue 41): only typed changes
    assert "checkpoint.interval: 5 -> 100 (the run has 5; this value comes from profile cpu-debug" in err
    assert "metrics.log_interval: 1 -> 10 (the run has 1;" in err
    code, err = cli(
        "--optimizer.lr=1e-4", "--metrics.log_interval=10", "--checkpoint.interval=5", "--train.max_steps=10"
    )
    assert code == 0, err
    [change] = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert change["changes"] == {
        "metrics.log_interval": {"from": 1, "to": 10},
        "train.max_steps": {"from": 300, "to": 10},
    }
    code, err = cli("--train.max_steps=20")  # the default learning rate would replace the run's
    assert code == 2
    assert "optimizer.lr: 0.0001 -> 0.003 (the run has 0.0001; this value comes from profile cpu-debug" in err
    assert f"kforge resume {run} --checkpoint.resume=auto --train.max_steps=20" in err
    assert (run / "config.toml").read_bytes() == original and len(
        (run / "config_changes.jsonl").read_text().splitlines()
    ) == 1
    code, err = cli()  # alone: the run's settings, with the change recorded
    assert code == 0, err
    assert "train.max_steps (10)" in err  # the warmup warning sees the recorded max_steps
    assert len((run / "config_changes.jsonl").read_text().splitlines()) == 1  # nothing new to record
