"""An evaluation per checkpoint (``eval.after_checkpoint``): `kforge eval` of each committed checkpoint
in a process of its own, so training never waits for it.

Two sides, one protocol (the files in `kforge_cli.rundir.eval_records`):

- the training's rank 0 (`CheckpointEvaluations`, driven by the loop component
  `engine.train.components.eval_after_checkpoint`): pins a checkpoint when it is saved, starts
  ``kforge eval STEP_DIR --after-checkpoint`` once the checkpoint is committed (a detached
  local process, or ``sbatch`` inside a SLURM job), writes the status ``running``, notices
  when a process it started ends (a killed one: status ``failed``, a warning, the pin
  removed) and hands finished results to the training's tracker (`relay`);
- the evaluation (`evaluate_after_checkpoint`, behind ``kforge eval --after-checkpoint``):
  takes the pin over, runs the tasks, writes ``eval/step_N.json`` and the MLflow /
  TensorBoard points at the checkpoint's step (never metrics.jsonl, which the training
  appends, and never W&B, whose run a second process would end), then its status ``done`` or
  ``failed``, and removes the pin, also on SIGTERM (``scancel``).

Every start, check and relay on the training's side is a file test, a ``waitpid`` or a
fork: the loop is held for milliseconds per checkpoint (measured: `blocked_s`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from kforge_cli.common.files import open_append, real_dir
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.checkpoints import commit_record, step_of
from kforge_cli.rundir.eval_records import (
    read_status,
    remove_pin,
    this_host,
    write_pin,
    write_status,
)
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.names import COMMIT_FILE
from kforge_cli.settings import JobSettings
from kforge_cli.settings.task_code import task_code_modules

log = logging.getLogger("kforge")

Results = dict[str, dict[str, float]]


# ---- the consent for task code --------------------------------------------------------------


# ---- the training's side ----------------------------------------------------------------------


def eval_command(settings: JobSettings, step_dir: Path) -> list[str]:
    """The `kforge eval` command line of one checkpoint's evaluation."""
    e = settings.eval
    cmd = [sys.executable, "-m", "kforge_cli", "eval", str(step_dir)]
    for spec in e.after_checkpoint_tasks:
        cmd += ["--task", spec]
    cmd += ["--max-batches", str(e.steps), "--device", e.after_checkpoint_device, "--after-checkpoint"]
    modules = task_code_modules(e.after_checkpoint_tasks)
    return cmd + ([f"--allow-hooks={','.join(modules)}"] if modules else [])


def use_sbatch(settings: JobSettings, env: dict[str, str] | None = None) -> bool:
    how = settings.eval.after_checkpoint_launcher
    return how == "sbatch" or (how == "auto" and "SLURM_JOB_ID" in (os.environ if env is None else env))


def _child_env(sbatch: bool) -> dict[str, str]:
    """The environment of an evaluation: the training's, without the distributed job's identity (and,
    for sbatch, without the allocation's SLURM_* values a nested submission would inherit)."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}
    if sbatch:
        env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}
    return env


@dataclass
class Evaluation:
    """One checkpoint's evaluation as the training sees it."""

    step: int
    step_dir: Path
    proc: subprocess.Popen[bytes] | None = None  # the eval process, or the sbatch that submits its job
    slurm_job: str | None = None
    state: str = "pending"  # pending (saved, not committed) -> starting -> running -> done / failed
    relayed: bool = False
    start_s: float = 0.0  # the loop's time to start it (status, pin, fork)


@dataclass
class CheckpointEvaluations:
    """Rank 0's evaluations per checkpoint (see the module docstring); every method returns at once."""

    settings: JobSettings
    run_dir: Path
    evaluations: dict[int, Evaluation] = field(default_factory=dict)
    blocked_s: float = 0.0  # the loop's time in these methods, all together
    launcher: Callable[[list[str], Path, dict[str, str]], subprocess.Popen[bytes]] | None = None
    _starter: ThreadPoolExecutor | None = None  # one thread forks the evaluations (the loop never does)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the evaluations already asked for are started (a fork each; never their end)."""
        if self._starter is not None:
            self._starter.shutdown(wait=timeout is None or timeout > 0)
            self._starter = None

    @property
    def run(self) -> RunDir:
        return RunDir(self.run_dir)

    def saved(self, step: int, step_dir: Path) -> None:
        """A checkpoint was saved (maybe still being written): pin it until its evaluation takes over."""
        write_pin(step_dir, os.getpid())
        self.evaluations[step] = Evaluation(step, step_dir)

    def start_committed(self) -> None:
        """Start the evaluation of every saved checkpoint that is now committed: the loop tests for the
        commit marker; writing the status and forking happen on a thread of their own."""
        for e in self.evaluations.values():
            if e.state == "pending" and (e.step_dir / COMMIT_FILE).is_file():
                e.state = "starting"
                if self._starter is None:
                    self._starter = ThreadPoolExecutor(1, thread_name_prefix="kforge-eval-start")
                self._starter.submit(self._start, e)

    def _start(self, e: Evaluation) -> None:
        t0 = time.perf_counter()
        if commit_record(e.step_dir) is None:  # a marker that does not describe a complete checkpoint
            self._failed(e, f"{e.step_dir} is not a complete checkpoint")
            return
        sbatch = use_sbatch(self.settings)
        cmd = eval_command(self.settings, e.step_dir)
        logs = real_dir(self.run.logs)
        log_path = logs / f"eval_step_{e.step}.log"
        if sbatch:
            cmd = [
                "sbatch",
                "--parsable",
                f"--job-name=kforge-eval-step_{e.step}",
                f"--output={logs / f'eval_step_{e.step}-%j.log'}",
                "--ntasks=1",
                *self.settings.eval.after_checkpoint_sbatch_args,
                f"--wrap=exec {shlex.join(cmd)}",
            ]
        # The status first: the evaluation adds its pid to it (and may end before this call returns).
        write_status(
            self.run_dir,
            e.step,
            {
                "state": "running",
                "pid": None,
                "launched_by": os.getpid(),
                "host": this_host(),
                "launcher": "sbatch" if sbatch else "process",
                "checkpoint": str(e.step_dir),
                "tasks": list(self.settings.eval.after_checkpoint_tasks),
                "started": time.time(),
                "log": str(log_path),
            },
        )
        try:
            e.proc = (self.launcher or _popen)(cmd, log_path, _child_env(sbatch))
        except OSError as exc:
            self._failed(e, f"could not start {cmd[0]}: {exc}")
            return
        e.state = "running"  # (after e.proc: the loop's `check` reads both) the pin is the training's until
        # the evaluation writes its own
        e.start_s = time.perf_counter() - t0
        log.info("evaluation of checkpoint step %d started (pid %d, log %s)", e.step, e.proc.pid, log_path)

    def check(self) -> None:
        """Notice the evaluations (and sbatch submissions) that ended; report a failed one."""
        for e in self.evaluations.values():
            if e.state != "running" or e.proc is None:
                continue
            code = e.proc.poll()
            if code is None:
                continue
            if use_sbatch(self.settings) and e.slurm_job is None:
                self._submitted(e, code)
                continue
            e.proc = None
            self._ended(e, code)

    def _submitted(self, e: Evaluation, code: int) -> None:
        out = e.proc.stdout.read().decode(errors="replace").strip() if e.proc and e.proc.stdout else ""
        e.proc = None
        if code != 0 or not out:
            self._failed(e, f"sbatch refused the evaluation's job (exit {code}): {out[:300]}")
            return
        e.slurm_job = out.split(";")[0]
        status = read_status(self.run_dir, e.step) or {}
        if status.get("state") == "running":  # the job may have started (and written) already
            write_status(self.run_dir, e.step, {**status, "slurm_job": e.slurm_job})
        log.info("evaluation of checkpoint step %d submitted as SLURM job %s", e.step, e.slurm_job)

    def _ended(self, e: Evaluation, code: int) -> None:
        status = read_status(self.run_dir, e.step) or {}
        if code == 0 and status.get("state") == "done":
            e.state = "done"
            return
        if status.get("state") == "failed":  # the evaluation said why
            why = str(status.get("error"))
        else:
            why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            write_status(self.run_dir, e.step, {**status, "state": "failed", "error": why, "ended": time.time()})
            remove_pin(e.step_dir)  # its holder is gone
        self._failed(e, why)

    def _failed(self, e: Evaluation, why: str) -> None:
        e.state = "failed"
        status = read_status(self.run_dir, e.step) or {}
        if status.get("state") != "failed":
            write_status(self.run_dir, e.step, {**status, "state": "failed", "error": why, "ended": time.time()})
        remove_pin(e.step_dir)
        log.warning(
            "evaluation of checkpoint step %d failed (%s); see %s; training continues",
            e.step,
            why,
            self.run.logs / f"eval_step_{e.step}.log",
        )

    def finished_results(self) -> list[tuple[int, Results]]:
        """The results of evaluations that ended since the last call (each once), oldest first.

        SLURM jobs are not this process's children: their status files say when they end."""
        out: list[tuple[int, Results]] = []
        for e in sorted(self.evaluations.values(), key=lambda x: x.step):
            if e.relayed:
                continue
            if e.state == "running" and e.proc is None and e.slurm_job is not None:
                status = read_status(self.run_dir, e.step) or {}
                if status.get("state") in ("done", "failed"):
                    e.state = str(status["state"])
                    if e.state == "failed":
                        log.warning(
                            "evaluation of checkpoint step %d (SLURM job %s) failed: %s",
                            e.step,
                            e.slurm_job,
                            status.get("error"),
                        )
            if e.state == "done":
                e.relayed = True
                tasks = (read_status(self.run_dir, e.step) or {}).get("results")
                if isinstance(tasks, dict):
                    out.append((e.step, _numbers(tasks)))
            elif e.state == "failed":
                e.relayed = True
        return out

    def counts(self) -> dict[str, int]:
        tally = {"pending": 0, "starting": 0, "running": 0, "done": 0, "failed": 0}
        for e in self.evaluations.values():
            tally[e.state] += 1
        return tally


def _numbers(tasks: dict[str, object]) -> Results:
    out: Results = {}
    for name, metrics in tasks.items():
        if isinstance(metrics, dict):
            out[str(name)] = {
                str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
    return out


def _popen(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A detached process (its own session: the training's Ctrl-C and end leave it running)."""
    sbatch = cmd[0] == "sbatch"
    with open_append(log_path) as out:  # never through a link planted in the run directory
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if sbatch else out,
            stderr=subprocess.STDOUT if not sbatch else out,
            env=env,
            start_new_session=True,
            close_fds=True,
        )


def flat_record(results: Results) -> dict[str, float]:
    """``eval/<task>/<metric>`` -> value (the tracker's names, as `kforge eval --track` logs them)."""
    return {f"eval/{task}/{name}": value for task, metrics in results.items() for name, value in metrics.items()}


# ---- the evaluation's side -----------------------------------------------------------------------


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated(f"terminated by {signal.Signals(signum).name}")


def evaluate_after_checkpoint(
    ckpt: Path,
    tasks: list[str],
    *,
    max_batches: int | None,
    limit: int | None,
    tokenizer: str | None,
    device: str,
    allow_hooks: list[str] | None,
) -> int:
    """`kforge eval --after-checkpoint`: evaluate ``ckpt`` holding its pin, record the status; the exit code."""
    from kforge_cli.engine.evaluation.tasks import check_task, log_to_trackers, run_task, task_name, write_results
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference

    step_dir = Path(ckpt).expanduser().resolve()
    step = step_of(step_dir)
    found = RunDir.of_checkpoint(step_dir)
    if step is None or found is None:
        raise InvalidInputError(f"--after-checkpoint: {ckpt} is not a step_N directory of a run directory")
    run_dir = found.path
    job = os.environ.get("SLURM_JOB_ID")
    write_pin(step_dir, os.getpid(), slurm_job=job)
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.time()
    status = read_status(run_dir, step) or {}
    status.update({"state": "running", "pid": os.getpid(), "host": this_host(), "evaluation_started": t0})
    if job:
        status["slurm_job"] = job
    write_status(run_dir, step, status)
    code = 1
    try:
        for spec in tasks:
            check_task(spec, allow_hooks)
        loaded = open_for_inference(step_dir, device=device, tokenizer=tokenizer)
        results = {
            task_name(spec): run_task(loaded, spec, max_batches=max_batches, limit=limit, allow_hooks=allow_hooks)
            for spec in tasks
        }
        path = write_results(loaded, results)
        tracked = log_to_trackers(loaded, results, to_file=False)  # metrics.jsonl: the training relays them
        status.update({"state": "done", "results": results, "file": str(path), "tracked": tracked})
        code = 0
    except (Exception, _Terminated) as exc:
        status.update({"state": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]})
        log.warning("evaluation of %s failed: %s", step_dir, status["error"])
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        status.update({"ended": time.time(), "seconds": time.time() - t0})
        remove_pin(step_dir)  # first: a reader that sees the end sees the checkpoint free
        write_status(run_dir, step, status)
    return code
