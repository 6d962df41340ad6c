"""Benchmark: what the hang watchdog and the straggler report cost the default job.

Alternating runs of the same job with both on (the defaults) and both off
(``resilience.hang_timeout_s=0``, ``resilience.straggler_ratio=0``), one process in this
process (``--procs 1``: the watchdog only, the report needs two ranks) or
``kforge train --nproc-per-node N`` (``--procs 2``: both). Throughput is measured by the
wall clock between step ends (so the report's all-gather on logging steps and the
watchdog's thread count), skipping the first ``--warmup`` steps; the median over runs of
each arm gives the ratio. Target: on/off >= 0.99 (under 1%). Prints a table, writes
bench/results/resilience_overhead.json.

    python bench/resilience_overhead.py [--procs 1|2] [--runs 5] [--steps 100] [--warmup 10] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ON: list[str] = []  # the defaults: watchdog with the automatic limit, straggler report at ratio 1.5
OFF = ["--resilience.hang_timeout_s=0", "--resilience.straggler_ratio=0"]


def _hook_class() -> Any:
    from kforge_cli.engine.train import TrainHook

    class StepTimes(TrainHook):
        """Wall time at every step end; rank 0 writes them to $KFORGE_BENCH_TIMES at the end."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.report_s: list[float] = []

        def on_train_begin(self, session: Any) -> None:
            from kforge_cli.engine.resilience import straggler

            report = straggler.StragglerMonitor.report
            spent = self.report_s

            def timed(monitor: Any, step: int) -> Any:  # the report's own cost, on logging steps
                t0 = time.perf_counter()
                try:
                    return report(monitor, step)
                finally:
                    spent.append(time.perf_counter() - t0)

            straggler.StragglerMonitor.report = timed  # type: ignore[method-assign]
            self.times = [time.perf_counter()]

        def on_step_end(self, session: Any, info: Any) -> None:
            self.times.append(time.perf_counter())

        def on_train_end(self, session: Any, status: str) -> None:
            target = os.environ.get("KFORGE_BENCH_TIMES")
            if target and session.runtime.is_main:
                Path(target).write_text(json.dumps({"times": self.times, "report_s": self.report_s}))

    return StepTimes


StepTimes = _hook_class()


def tokens_per_sec(times: list[float], warmup: int, tokens_per_step: int) -> float:
    steady = times[warmup:]
    return tokens_per_step * (len(steady) - 1) / (steady[-1] - steady[0])


def hot_path_us(iterations: int = 20000) -> float:
    """Microseconds per step of what the loop adds on an ordinary step: 9 phase marks and a beat
    (watchdog), two timestamps around the update (straggler report, CPU)."""
    import torch

    from kforge_cli.engine.resilience import HangWatchdog, StragglerMonitor

    wd = HangWatchdog(rank=0, world_size=2, directory=Path("/nonexistent"), timeout_s=None, pg_timeout_s=1800)
    sm = StragglerMonitor(rank=0, world_size=2, device=torch.device("cpu"), ratio=1.5, windows=3, local_params=1)
    phases = ("stop vote", "data", "forward/backward", "update", "log", "hooks", "rewind", "checkpoint")
    t0 = time.perf_counter()
    for i in range(iterations):
        for phase in phases:
            wd.mark(phase)
        token = sm.begin_update()
        sm.end_update(token, 0.0)
        wd.beat(i)
        if i % 10 == 0:
            sm._samples.clear()
    return (time.perf_counter() - t0) / iterations * 1e6


def one_run(
    common: list[str], arm: list[str], procs: int, warmup: int, tokens_per_step: int
) -> tuple[float, float, list[float]]:
    """(tokens per second, median step seconds, the report's seconds on each logging step)."""
    with tempfile.TemporaryDirectory() as tmp:
        times_file = Path(tmp) / "times.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
            "KFORGE_BENCH_TIMES": str(times_file),
        }
        cmd = [sys.executable, "-m", "kforge_cli", "train", "--run-dir", f"{tmp}/run", *common, *arm]
        if procs > 1:
            cmd[4:4] = ["--nproc-per-node", str(procs)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"training failed ({r.returncode}):\n{r.stderr[-3000:]}")
        data = json.loads(times_file.read_text())
        times = data["times"]
        steps = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :], strict=False)]
        return tokens_per_sec(times, warmup, tokens_per_step), statistics.median(steps), data["report_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="one process, one short run per arm, no results file")
    args, overrides = ap.parse_known_args()
    if args.smoke:
        args.procs, args.runs, args.steps, args.warmup = 1, 1, 12, 2
    from kforge_cli.settings import load_settings

    common = [
        f"--train.max_steps={args.steps}",
        "--eval.interval=0",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--metrics.progress_bar=off",
        '--train.hooks=["bench.resilience_overhead:StepTimes"]',
        *overrides,
    ]
    settings = load_settings(overrides=common).settings
    t = settings.train
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum_steps * args.procs  # dp over all processes
    runs: dict[str, list[float]] = {"on": [], "off": []}
    step_s: list[float] = []
    report_s: list[float] = []
    for i in range(args.runs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")  # alternate which arm goes first
        for name in order:
            tps, step, reports = one_run(common, ON if name == "on" else OFF, args.procs, args.warmup, tokens_per_step)
            runs[name].append(tps)
            if name == "on":
                step_s.append(step)
                report_s += reports
            print(f"run {i + 1} {name:<3} {tps:>10,.0f} tok/s", flush=True)
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    paired = [a / b for a, b in zip(runs["on"], runs["off"], strict=True)]
    print(f"\n{'arm':<5}{'median tok/s':>14}{'min':>12}{'max':>12}")
    for name in ("on", "off"):
        xs = runs[name]
        print(f"{name:<5}{statistics.median(xs):>14,.0f}{min(xs):>12,.0f}{max(xs):>12,.0f}")
    print(
        f"ratio on/off = {on / off:.4f} (median of paired runs {statistics.median(paired):.4f}, "
        f"spread {min(paired):.3f}-{max(paired):.3f}); target >= 0.99"
    )
    hot = hot_path_us()
    step_us = statistics.median(step_s) * 1e6
    report_us = statistics.median(report_s) * 1e6 if report_s else 0.0
    direct = (hot + report_us / settings.metrics.log_interval) / step_us
    print(
        f"direct cost: {hot:.2f} us per step (watchdog marks + straggler timestamps) + {report_us:.0f} us per "
        f"logging step (straggler all-gather, every {settings.metrics.log_interval} steps) = {100 * direct:.3f}% "
        f"of the median step ({step_us / 1000:.1f} ms)"
    )
    result = {
        "hot_path_us_per_step": hot,
        "report_us_per_logging_step": report_us,
        "median_step_us": step_us,
        "direct_overhead_fraction": direct,
        "procs": args.procs,
        "runs": runs,
        "steps": args.steps,
        "warmup": args.warmup,
        "on_tokens_per_sec": on,
        "off_tokens_per_sec": off,
        "ratio": on / off,
        "paired_ratios": paired,
        "overrides": overrides,
    }
    if args.smoke:  # checks the script; its figures mean nothing
        return
    out = HERE / "results" / f"resilience_overhead_{args.procs}proc.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
