"""`kforge runs`: one row per run directory, read from its files (and SLURM, for jobs) without torch.

Status, first match wins:

- ``running``: a live process holds the run directory's lock (probed without taking it:
  `kforge_cli.rundir.lock.probe_run_lock`);
- ``queued`` / ``running``: SLURM says the run's job is pending / running (``squeue``);
- how the last job ended, from RUN_DIR/exit.json (`kforge_cli.rundir.launch`): exit 0
  ``done``, 75 ``stopped (signal)``, 76 ``hung (watchdog)``, 130 ``interrupted``, any other
  code ``failed``;
- ``early_stop`` (or another loop component's stop): the newest checkpoint was saved when it stopped the run;
- ``done``: the final checkpoint was written, or the planned steps were logged (a run from
  before exit records);
- ``hung (watchdog)`` also when the lock is free and logs/hang/summary.txt is there (a single
  process's watchdog exits without a record; a restart moves the report aside);
- ``killed``: the lock is free on this host and the last job left no exit record (``kill -9``,
  the OOM killer, a lost node);
- where the lock cannot be probed from here (its holder ran on another host, or no lock table):
  ``running`` when metrics.jsonl or a log changed within ``active_s`` seconds; ``stopped
  (signal)`` when the newest checkpoint was saved on a signal; a run written by ``--sbatch``:
  the state ``sacct`` reports for its last job (lower case: ``cancelled``, ``timeout``,
  ``failed`` ...), else ``not submitted`` or ``unknown``; else ``failed``.

The evals column (shown when a run has any) counts ``eval.after_checkpoint``'s evaluations as
done/running/failed, from RUN_DIR/eval/step_N.status.json (a running one whose process is gone
from this host counts as failed).

The steps column is the step of the newest complete checkpoint or of the last logged step,
whichever is later. Metrics are read from the end of metrics.jsonl, so a long run costs no more
than a short one.
"""

from __future__ import annotations

import getpass
import json
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kforge_cli.common.files import read_text_capped
from kforge_cli.errors import InvalidInputError, KforgeError
from kforge_cli.rundir.checkpoints import newest_complete, step_of
from kforge_cli.rundir.eval_records import eval_counts
from kforge_cli.rundir.launch import read_exit
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.lock import probe_run_lock
from kforge_cli.rundir.metrics_tail import last_values
from kforge_cli.rundir.names import HANG_DIR, HANG_SUMMARY_FILE, SUMMARY_FILE
from kforge_cli.rundir.saved_config import read_saved_config

SLURM_TIMEOUT_S = 5.0
MAX_SMALL_FILE = 1 << 20  # a job list or checkpoint summary kforge writes is a few KB
_SQUEUE_LIVE = {"PENDING": "queued", "REQUEUED": "queued", "CONFIGURING": "running", "RUNNING": "running"}
EXIT_STATUS = {0: "done", 75: "stopped (signal)", 76: "hung (watchdog)", 130: "interrupted"}
STOPPED = EXIT_STATUS[75]


@dataclass
class RunRow:
    name: str
    profile: str | None
    steps_done: int
    steps_planned: int | None
    last_loss: float | None
    eval_loss: float | None
    latest_checkpoint: str | None
    status: str
    last_update: str | None
    path: str
    slurm_job: str | None = None  # the run's last SLURM job id, when it has one
    evals: str | None = None  # eval.after_checkpoint's evaluations: done/running/failed (None: none)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SlurmView:
    """What SLURM says about the jobs of the listed runs (one squeue call, one sacct call)."""

    available: bool = False  # squeue ran: a job missing from it is not queued or running
    live: dict[str, str] = field(default_factory=dict)  # job id -> squeue state
    scripts: dict[str, str] = field(default_factory=dict)  # job script path -> job id (jobs submitted by hand)
    ended: dict[str, str] = field(default_factory=dict)  # job id -> sacct state


def _run(argv: list[str]) -> str | None:
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def ask_slurm(job_ids: Iterable[str]) -> SlurmView:
    """The user's queued and running jobs (squeue), and the final state of `job_ids` no longer queued (sacct)."""
    view = SlurmView()
    out = _run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%T|%o"])
    if out is not None:
        view.available = True
        for line in out.splitlines():
            parts = line.strip().split("|", 2)
            if len(parts) == 3:
                job, state, command = parts
                view.live[job] = state
                view.scripts.setdefault(command, job)
    gone = sorted({j for j in job_ids if j not in view.live})
    if gone:
        out = _run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(gone)])
        for line in (out or "").splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 2 and parts[0]:
                view.ended[parts[0]] = parts[1].split()[0]  # "CANCELLED by 123" -> CANCELLED
    return view


def job_ids(run: RunDir) -> list[str]:
    """The run's SLURM job ids, oldest first: those --submit recorded, and those whose log file exists."""
    ids: list[str] = []
    try:
        for line in read_text_capped(run.slurm_jobs, MAX_SMALL_FILE, "job list").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("job_id"):
                ids.append(str(record["job_id"]))
    except (OSError, KforgeError):
        pass
    logs = sorted(run.logs.glob("slurm-*.out"), key=lambda p: p.stat().st_mtime) if run.logs.is_dir() else []
    ids += [p.name[len("slurm-") : -len(".out")] for p in logs]
    return list(dict.fromkeys(ids))


def _logs(run: RunDir) -> list[Path]:
    return sorted(run.logs.glob("*")) if run.logs.is_dir() else []


def _mtime(run: RunDir, paths: Iterable[Path]) -> float | None:
    """The newest modification time of `paths` (those that exist)."""
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue
    return max(times) if times else None


def _updated(run: RunDir) -> float | None:
    """When anything of the run last changed (its metrics, logs, settings or job script)."""
    return _mtime(run, (run.metrics, *_logs(run), run.config, run.config_changes, run.job_script))


def _checkpoint(run: RunDir, config: Mapping[str, object]) -> tuple[str | None, str | None]:
    """(the newest complete checkpoint's name, why it was saved) under the run's checkpoint root."""
    section = config.get("checkpoint")
    directory = section.get("dir") if isinstance(section, dict) else None
    root = Path(directory).expanduser() if isinstance(directory, str) and directory else run.checkpoints
    if root.is_symlink() or not root.is_dir():
        return None, None
    latest, _ = newest_complete(root)
    if latest is None:
        return None, None
    try:
        reason = json.loads(read_text_capped(latest / SUMMARY_FILE, MAX_SMALL_FILE, "summary")).get("reason")
    except (OSError, ValueError, RecursionError, AttributeError, KforgeError):
        reason = None
    return latest.name, reason if isinstance(reason, str) else None


def describe_run(
    run_dir: Path, *, now: float | None = None, active_s: float = 300.0, slurm: SlurmView | None = None
) -> RunRow:
    run = RunDir(run_dir)
    now = time.time() if now is None else now
    config = read_saved_config(run.path, missing_ok=True)
    train = config.get("train")
    max_steps = train.get("max_steps") if isinstance(train, dict) else None
    planned = max_steps if isinstance(max_steps, int) else None
    last = last_values(run.metrics, ("loss", "eval_loss"))
    logged = last["loss"][0] if "loss" in last else 0
    latest, reason = _checkpoint(run, config)
    saved = step_of(Path(latest)) if latest is not None else None
    step = max(logged, saved or 0)
    mtime = _mtime(run, (run.metrics, *_logs(run)))
    updated = _updated(run)
    ids = job_ids(run) if run.job_script.is_file() else []
    job = ids[-1] if ids else None
    if run.job_script.is_file() and slurm is not None and job is None:
        job = slurm.scripts.get(str(run.job_script.resolve()))  # submitted by hand: squeue knows its script
    live = slurm.live.get(job) if slurm is not None and job is not None else None
    held = probe_run_lock(run.path)
    ended = read_exit(run.path)
    code = ended.get("code") if ended is not None else None
    if held:
        status = "running"
    elif live is not None:
        status = _SQUEUE_LIVE.get(live, live.lower())
    elif code == 0 and reason not in (None, "interval", "final", "signal"):
        status = reason  # exit 0 from a loop component's stop (e.g. early_stop)
    elif isinstance(code, int) and not isinstance(code, bool):
        status = EXIT_STATUS.get(code, "failed")
    elif reason not in (None, "interval", "final", "signal"):  # a loop component stopped the run (early_stop)
        status = reason
    elif reason == "final" or (planned is not None and "loss" in last and logged >= planned):
        status = "done"
    elif held is False and (run.logs / HANG_DIR / HANG_SUMMARY_FILE).is_file():
        status = EXIT_STATUS[76]  # the watchdog's own exit leaves no record; its report (moved aside on a restart)
    elif held is False and run.lock_file.exists():
        status = "killed"  # a job took the lock, and ended without a word
    elif mtime is not None and now - mtime < active_s:
        status = "running"
    elif reason == "signal":
        status = STOPPED
    elif run.job_script.is_file():
        status = _job_status(run, job, slurm, started="loss" in last)
    else:
        status = "failed"
    return RunRow(
        name=run.name,
        profile=profile if isinstance(profile := config.get("profile"), str) else None,
        steps_done=step,
        steps_planned=planned,
        last_loss=last["loss"][1] if "loss" in last else None,
        eval_loss=last["eval_loss"][1] if "eval_loss" in last else None,
        latest_checkpoint=latest,
        status=status,
        last_update=time.strftime("%Y-%m-%d %H:%M", time.localtime(updated)) if updated else None,
        path=str(run.path),
        slurm_job=job,
        evals=counts.cell() if (counts := eval_counts(run.path)).total else None,
    )


def _job_status(run: RunDir, job: str | None, slurm: SlurmView | None, *, started: bool) -> str:
    """A `--sbatch` run that is neither complete, live nor stopped: what SLURM last said, never a guess."""
    if job is None:
        return "failed" if started else "not submitted"
    if slurm is not None and job in slurm.ended:
        return slurm.ended[job].lower()
    if slurm is not None and slurm.available and started:
        return "failed"  # not queued, not running, no final checkpoint: it ended early
    return "unknown"


def list_runs(root: Path, *, active_s: float = 300.0, now: float | None = None) -> list[RunRow]:
    """Every run directory (one with config.toml or metrics.jsonl) directly under `root`, newest first."""
    if not root.is_dir():
        raise InvalidInputError(f"{root} is not a directory; give the folder that holds your run directories")
    runs = [RunDir(d) for d in sorted(root.iterdir()) if d.is_dir()]
    runs = [r for r in runs if r.has_config() or r.metrics.is_file()]
    sbatch = [r for r in runs if r.job_script.is_file()]
    slurm = ask_slurm(j for r in sbatch for j in job_ids(r)[-1:]) if sbatch else None
    rows = [(describe_run(r.path, now=now, active_s=active_s, slurm=slurm), _updated(r)) for r in runs]
    return [row for row, _ in sorted(rows, key=lambda pair: pair[1] or 0.0, reverse=True)]
