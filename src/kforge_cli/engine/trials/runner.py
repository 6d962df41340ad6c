"""`kforge plan trial --best K --steps N`: run the K best layouts for N steps each and measure them.

Each trial is `kforge train` on a profile written for its layout (the same data, seed and
global batch for all), for N steps with no checkpoint or evaluation, one metrics record per
step. Locally the processes are started by `kforge train --nproc-per-node`; inside a SLURM
allocation (``SLURM_JOB_ID`` set) by ``srun`` with the layout's task count, each trial on its
own rendezvous port. The first ``warmup(N)`` steps are not timed (start-up, allocator
growth); the step time is the median of the rest, the peak memory the largest the metrics
saw (CUDA's allocated peak; on CPU rank 0's resident set, which includes the Python and
torch runtime the plan does not count). `--sbatch` writes a job script that runs the whole
search and sweep inside one allocation. Results also go to TRIAL_DIR/trials.json (what
`kforge plan calibrate` fits the cost model to). Each trial's predicted step is the cost model's
(``plan.cost_model``), the number `kforge plan` prints for its profile.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import atomic_write, open_append, output_dir, real_dir
from kforge_cli.errors import InvalidInputError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from kforge_cli.engine.plan.search import Candidate, SearchResult
    from kforge_cli.settings import JobSettings

TRIAL_OVERRIDES = [
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
    "--eval.interval=0",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
]


def isolate(settings: JobSettings, run_dir: Path) -> tuple[JobSettings, list[str]]:
    """`settings` for a trial in `run_dir`: everything pointing outside it set by the trial; what was overridden.

    A trial never resumes from, loads, writes or deletes anything outside its run directory
    (TRIAL_DIR/trial-K/run): its checkpoints are RUN_DIR/checkpoints and it never resumes
    (``checkpoint.dir``, ``load_path``, ``init_from``, ``resume``), it logs to its own
    metrics.jsonl only (no W&B, MLflow or TensorBoard run to continue) and records no
    profiler trace. Returns a copy (`settings` is untouched) and the overridden settings the
    user had set, as ``key=value``.
    """
    changes: list[str] = []

    def own(section: str, values: dict[str, object], quiet: tuple[str, ...] = ()) -> BaseModel:
        current: BaseModel = getattr(settings, section)
        update = {k: v for k, v in values.items() if getattr(current, k) != v}
        changes.extend(
            f"{section}.{k}={getattr(current, k)!r}"
            for k in update
            if k not in quiet and getattr(current, k) not in (None, [], False)
        )
        return current.model_copy(update=update)

    checkpoint = own(
        "checkpoint",
        {
            "dir": str(run_dir / "checkpoints"),
            "load_path": None,
            "init_from": None,
            "exclude_from_loading": [],
            "resume": "never",
        },
        quiet=("resume",),
    )
    metrics = own("metrics", {"backends": ["jsonl"], "wandb_run_id": None, "mlflow_run_id": None})
    profiling = own("profiling", {"enabled": False, "trace_dir": None})
    train = own("train", {"run_dir": str(run_dir)})
    update = {"checkpoint": checkpoint, "metrics": metrics, "profiling": profiling, "train": train}
    return settings.model_copy(update=update), changes


def warmup(steps: int) -> int:
    """Steps left out of the timing: a quarter of them, at least one."""
    return max(1, steps // 4)


@dataclass
class TrialResult:
    """One trial: the layout, its prediction and what the run measured (None when it failed)."""

    index: int
    layout: str
    overrides: list[str]
    world_size: int
    predicted_step_s: float
    predicted_tokens_per_s: float
    planned_peak_gib: float
    profile: str
    run_dir: str
    log: str
    exit_code: int
    measured_step_s: float | None = None
    measured_tokens_per_s: float | None = None
    measured_peak_gib: float | None = None
    peak_kind: str = ""
    timed_steps: int = 0

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured step time."""
        if self.measured_step_s is None:
            return None
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s


def default_trial_dir() -> Path:
    return Path("runs") / f"plan-trials-{time.strftime('%Y%m%d-%H%M%S')}"


def _fresh_dir(path: Path | None) -> Path:
    out = output_dir(path or default_trial_dir(), "trial")
    if out.exists() and any(out.iterdir()):
        raise InvalidInputError(f"--trial-dir {out} is not empty; choose a new directory")
    return real_dir(out)


def in_slurm_allocation(env: dict[str, str] | None = None) -> bool:
    """Inside an allocation (a batch script or salloc) but not inside a job step: trials go through srun."""
    env = dict(os.environ) if env is None else env
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env


def trial_command(
    profile: Path, run_dir: Path, steps: int, world: int, nodes: int, per_node: int, *, slurm: bool
) -> list[str]:
    """The command of one trial (``kforge train`` on its profile, locally or under srun)."""
    train = ["-m", "kforge_cli", "train", "--profile", str(profile), f"--train.max_steps={steps}"]
    train += [f"--train.run_dir={run_dir}", *TRIAL_OVERRIDES]
    if slurm:
        srun = ["srun", f"--nodes={nodes}", f"--ntasks={world}", f"--ntasks-per-node={per_node}"]
        return [*srun, "--kill-on-bad-exit=1", sys.executable, *train]
    local = ["--nproc-per-node", str(world)] if world > 1 else []
    return [sys.executable, *train, *local]


def _trial_env(index: int, slurm: bool) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)  # stale launcher variables would make every task think it is torchrun's
    for name in [n for n in env if n.upper().startswith("KFORGE_") and "__" in n]:
        del env[name]  # KFORGE_SECTION__KEY: already in the trial's profile, less what isolate() set
    if slurm:
        from kforge_cli.engine.runtime.launcher import port_from_job_id

        env["MASTER_PORT"] = str(port_from_job_id(env.get("SLURM_JOB_ID", "0")) + 1 + index)
    return env


def read_measurements(metrics: Path, steps: int) -> dict[str, object]:
    """Median step time and tokens/s over the timed steps, and the peak memory, from a run's metrics.jsonl."""
    from kforge_cli.common.json_values import float_of, int_of
    from kforge_cli.engine.observe.metrics_file import iter_metrics

    records = [r for r in iter_metrics(metrics) if "step_time_s" in r] if metrics.is_file() else []
    timed = [r for r in records if int_of(r.get("step", 0)) > warmup(steps)]
    if not timed:
        return {}
    step = statistics.median(float_of(r["step_time_s"]) for r in timed)
    tps = statistics.median(float_of(r["tokens_per_sec"]) for r in timed)
    cuda = [float_of(r["peak_mem_gib"]) for r in records if "peak_mem_gib" in r]
    rss = [float_of(r["peak_rss_gib"]) for r in records if "peak_rss_gib" in r]
    peak, kind = (max(cuda), "GPU allocated") if cuda else ((max(rss), "RSS (rank 0)") if rss else (None, ""))
    return {
        "measured_step_s": step,
        "measured_tokens_per_s": tps,
        "measured_peak_gib": peak,
        "peak_kind": kind,
        "timed_steps": len(timed),
    }


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_trials(
    settings: JobSettings,
    result: SearchResult,
    candidates: list[Candidate],
    steps: int,
    trial_dir: Path | None,
    *,
    say: Callable[[str], None] = _stderr,
) -> list[TrialResult]:
    """Run each candidate for ``steps`` steps (see the module docstring); write TRIAL_DIR/trials.json."""
    from kforge_cli.engine.plan.written_profile import candidate_profile
    from kforge_cli.rundir.layout import RunDir
    from kforge_cli.settings.profile_writer import extends_name

    out = _fresh_dir(trial_dir)
    slurm = in_slurm_allocation()
    results: list[TrialResult] = []
    _, reset = isolate(settings, out)
    if reset:
        say(f"trials: not using {', '.join(reset)}: a trial resumes, loads and writes nothing outside {out}")
    for i, cand in enumerate(candidates, 1):
        here = real_dir(out / f"trial-{i}")
        profile = here / "profile.toml"
        run_dir = here / "run"
        own = replace(cand, settings=isolate(cand.settings, run_dir)[0])
        try:
            text = candidate_profile(settings, own)
        except InvalidInputError as exc:  # the profile it extends sets a path a trial cannot unset in TOML
            raise InvalidInputError(
                f"cannot write trial {i}'s profile: {exc}. A trial runs only inside {out}: use a profile without it"
            ) from None
        atomic_write(profile, text.encode())
        sl = cand.settings.slurm
        cmd = trial_command(profile, run_dir, steps, cand.dims.world_size, sl.nodes, sl.gpus_per_node, slurm=slurm)
        log = here / "train.log"
        say(f"trial {i}/{len(candidates)}: {cand.layout.describe()} ({'srun' if slurm else 'local'})")
        with open_append(log) as f:  # no-follow, like every write into a directory kforge made
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_trial_env(i, slurm)).returncode
        e = cand.estimate
        trial = TrialResult(
            index=i,
            layout=cand.layout.describe(),
            overrides=cand.layout.overrides(),
            world_size=cand.dims.world_size,
            predicted_step_s=e.step_s,
            predicted_tokens_per_s=e.tokens_per_s,
            planned_peak_gib=cand.peak_bytes / 2**30,
            profile=str(profile),
            run_dir=str(run_dir),
            log=str(log),
            exit_code=code,
        )
        if code == 0:
            for key, value in read_measurements(RunDir(run_dir).metrics, steps).items():
                setattr(trial, key, value)
        results.append(trial)
    summary = {
        "profile": extends_name(settings),  # what `kforge plan calibrate --output` extends
        "world_size": result.world_size,
        "gpu_type": result.gpu_type,
        "steps": steps,
        "warmup_steps": warmup(steps),
        "launcher": "srun" if slurm else "local",
        "trials": [{**asdict(t), "error": t.error} for t in results],
    }
    atomic_write(out / "trials.json", (json.dumps(summary, indent=2) + "\n").encode())
    return results


def failed_trials(results: list[TrialResult]) -> list[TrialResult]:
    """The trials that measured nothing (a non-zero exit, or no timed step)."""
    return [t for t in results if t.measured_step_s is None]


def format_trials(results: list[TrialResult], steps: int) -> str:
    """Predicted beside measured, ranked by the measured step time (failed trials last)."""
    ranked = sorted(results, key=lambda t: (t.measured_step_s is None, t.measured_step_s or 0.0))
    kind = next((t.peak_kind for t in results if t.peak_kind), "")
    lines = [
        "",
        f"trials: {steps} steps each, the first {warmup(steps)} not timed; ranked by the measured step time",
        f"  {'rank':>4} {'#':>2} {'predicted':>10} {'measured':>10} {'error':>7} {'pred tok/s':>11} "
        f"{'meas tok/s':>11} {'planned':>9} {'measured peak':>14}  layout",
    ]
    for n, t in enumerate(ranked, 1):
        if t.measured_step_s is None or t.measured_tokens_per_s is None:
            why = f"exit {t.exit_code}" if t.exit_code else "exit 0 but no timed step measured"
            lines.append(
                f"  {'-':>4} {t.index:>2} {t.predicted_step_s:>9.3g}s {'failed':>10} {'':>7} "
                f"{t.predicted_tokens_per_s:>11,.0f} {'':>11} {t.planned_peak_gib:>7.2f}G {'':>14}  {t.layout} "
                f"({why}; see {t.log})"
            )
            continue
        peak = f"{t.measured_peak_gib:.2f}G" if t.measured_peak_gib is not None else "-"
        lines.append(
            f"  {n:>4} {t.index:>2} {t.predicted_step_s:>9.3g}s {t.measured_step_s:>9.3g}s {t.error or 0.0:>+7.0%} "
            f"{t.predicted_tokens_per_s:>11,.0f} {t.measured_tokens_per_s:>11,.0f} {t.planned_peak_gib:>7.2f}G "
            f"{peak:>14}  {t.layout}"
        )
    if kind:
        lines.append(f"  (# = the search's rank; measured peak: {kind})")
    return "\n".join(lines)


SWEEP_SCRIPT = """#!/bin/bash
# kforge {version}: a layout-search trial sweep in one SLURM allocation.
# Written by `kforge plan trial --best K --sbatch`; the job searches, then runs
# each trial with srun (one task per GPU), and writes {trial_dir}/trials.json.
{directives}

set -uo pipefail
{exports}
{setup}
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}}

{command}
"""


def write_sweep_script(
    settings: JobSettings, argv: list[str], trial_dir: Path | None, *, say: Callable[[str], None] = _stderr
) -> tuple[Path, str]:
    """Write TRIAL_DIR/sweep.sbatch: this command (``argv``, without --sbatch) run inside the allocation;
    return its path and text."""
    from kforge_cli import __version__
    from kforge_cli.slurm.sbatch import _setup_block, env_exports, sbatch_directives, slurm_issues, task_python

    issues = slurm_issues(settings)
    if issues:
        from kforge_cli.errors import ConfigError

        raise ConfigError(issues, header="cannot write an sbatch script")
    out = _fresh_dir(trial_dir)
    real_dir(out / "logs")  # where #SBATCH --output points
    args = [a for a in argv if a != "--sbatch"]
    args = _drop_option(args, "--trial-dir")
    python = task_python(settings.slurm, sys.executable)
    command = [python, "-m", "kforge_cli", *args, "--trial-dir", str(out / "results")]
    directives = [
        line
        for line in sbatch_directives(settings.slurm, out, Path.cwd())
        if not line.startswith(("#SBATCH --requeue", "#SBATCH --signal", "#SBATCH --open-mode"))
    ]
    text = SWEEP_SCRIPT.format(
        version=__version__,
        trial_dir=out / "results",
        directives="\n".join(directives),
        exports="\n".join(env_exports(settings.slurm)),
        setup=_setup_block(settings.slurm),
        command=shlex.join(command),
    )
    script = out / "sweep.sbatch"
    atomic_write(script, text.encode(), 0o755)
    say(f"wrote {script}; submit with: sbatch {script}")
    return script, text


def _drop_option(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out
