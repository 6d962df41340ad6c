"""GPU acceptance cases (driven by bench/gpu/run): one table of what a GPU machine can show.

Rows, in order of value per second, under one shared deadline. Each case has a minimum
(the least time in which it can still give its row), an expected time and a cap; a case
starts only with at least its minimum left (else it is a row saying it was skipped), its
cap is cut to what is left, and one that fails or times out is a row saying so, never an
abort. ``--plan`` prints this schedule without running anything (no CUDA needed).

1. an 8B-shaped model at bf16 + compile: Llama-3-8B's block (dim 4096, GQA 32/8, FFN
   14336) with 16 of its 32 blocks and half its vocabulary, so the output head's share of
   the training FLOPs is the full 8B's (6.5% at 2k tokens; 4 blocks with the full
   vocabulary would put 36% there and its MFU would not represent an 8B). On a GPU under
   100 GiB (an H100: kforge's planner puts the 16 blocks at ~87 GiB) 8 blocks and a quarter
   of the vocabulary, the same FLOP mix, the row says so;
2. the same model at float8 + compile;
3. async checkpoint saves with pinned staging (~1B model, eager): the loop's blocked time
   per save against the step time, save MB/s against a ``dd`` of the same size on the same
   disk, and a resume equal to the uninterrupted steps (a small model);
4. FlexAttention vs dense-mask SDPA with document masking at 8k tokens
   (bench/attention_speed.py);
5. a moe16b-shaped MoE (4 blocks, one GPU holds every expert): bf16 grouped GEMM, compiled;
6. the ``gpu``-marked tests (counts whatever happens; tests needing more GPUs than present
   are counted apart as "not run here");
7. with 2+ GPUs: FSDP over every GPU and TP = 2 (rows saying "needs 2 GPUs" on one).

Train rows: tokens/s (median step after warm-up, each step timed to a device sync), MFU
over the GPU's bf16 peak, steady-state peak memory. Writes at most three files to the
output directory: results.json (the rows), logs.txt (every case's output) and
gpu-tests.xml (the tests' JUnit report); prints the table, then the rows as JSON, last.

    python bench/gpu/acceptance.py run --out-dir DIR [--deadline EPOCH_S | --budget-s S]
    python bench/gpu/acceptance.py plan [--budget-s 500] [--gpus 1]  # the schedule, nothing run
    python bench/gpu/acceptance.py case NAME --out ROW.json     # one case (what `run` starts)
    python bench/gpu/acceptance.py versions                     # what bench/gpu/run prints first
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "gpu"
BUDGET_S = 500.0  # everything bench/gpu/run does, install included, fits one 9-minute command
SETUP_S = 20.0  # bench/gpu/run before the first case: the offline install, the versions, kforge's import
TEST_LIMIT_S = 120  # per gpu test: one cold compile of a small block with an eager reference (test_gpu.py)
TESTS_STOP_S = 25.0  # the tests row's pytest stops starting tests this long before the row's time is up

LLAMA3_8B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden_dim": 14336}
LLAMA3_8B_VOCAB = 128256
EIGHT_B_LAYERS = 16
BIG_GPU_GIB = 100.0  # an H200 (141 GB) holds the 16-block 8B shape; an H100 (80 GB) runs 8 blocks (fitted_overrides)
EIGHT_B_SHAPED = [  # Llama-3-8B's block; 16 of 32 blocks and half the vocabulary: the full 8B's FLOP mix
    "--model.dim=4096",
    f"--model.n_layers={EIGHT_B_LAYERS}",
    "--model.n_heads=32",
    "--model.n_kv_heads=8",
    "--model.ffn_hidden_dim=14336",
    f"--model.vocab_size={LLAMA3_8B_VOCAB * EIGHT_B_LAYERS // LLAMA3_8B['n_layers']}",
    "--model.max_seq_len=2048",
    "--train.batch_size=2",
]
ONE_B = [  # ~1.0B parameters, as bench/single_gpu_throughput.py (the multi-GPU rows)
    "--model.dim=2048",
    "--model.n_layers=18",
    "--model.n_heads=16",
    "--model.n_kv_heads=8",
    "--model.vocab_size=32768",
    "--model.max_seq_len=2048",
    "--train.batch_size=4",
]
TRAIN = [
    "--train.seq_len=2048",
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
    "--eval.interval=0",
    "--checkpoint.save_final=false",
    "--checkpoint.interval=0",
    "--metrics.progress_bar=off",
    "--scheduler.warmup_steps=2",
    "--data.num_workers=0",
]
MOE_PROFILE = "moe16b-h100x8"
MOE = [  # with the profile above
    "--model.n_layers=4",
    "--distributed.ep=1",  # the profile's ep = 8 is for 8 GPUs; one GPU holds every expert
    "--train.grad_accum_steps=1",
    "--train.device=cuda",
    "--eval.interval=0",
    "--checkpoint.save_final=false",
    "--checkpoint.interval=0",
    "--metrics.progress_bar=off",
    "--data.num_workers=0",
]
COMPILE = ["--train.compile_model=true"]
FLOAT8 = ["--train.compile_model=true", "--train.float8=true"]
EIGHT_B = "8B-shaped/16L"
MOE_COMPILED = "moe16b-shaped/4L bf16+compile"
SAVE_CASE = "1B async save (pinned), resume"
SAVE = [  # with ONE_B, eager (the save, not the compile, is measured)
    "--train.seq_len=2048",
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
    "--eval.interval=0",
    "--metrics.progress_bar=off",
    "--metrics.log_interval=1",
    "--scheduler.warmup_steps=2",
    "--data.num_workers=0",
    "--checkpoint.async_mode=async_with_pinned_mem",
    "--checkpoint.save_final=false",  # one save (at the interval): ~11.6 GB to write, not twice that
    "--checkpoint.keep_last_n=1",
]


@dataclass
class Case:
    """One row: a training run (``overrides``), the attention bench, the gpu tests or the async saves.

    ``min_s``: the least time in which the case can still give its row (it is not started
    with less left); ``expected_s``: what it is expected to take (the plan's start times);
    ``cap_s``: the most it may take (less when the deadline is nearer)."""

    name: str
    kind: str  # "train" | "attention" | "tests" | "save"
    cap_s: int
    overrides: list[str] = field(default_factory=list)
    nproc: int = 1  # 0: every GPU
    min_gpus: int = 1
    profile: str | None = None
    min_s: int = 30
    expected_s: int = 60


def cases() -> list[Case]:
    """In order of value per second: what runs first is what a short budget still shows.

    Budget 500 s (one command of at most ~9 minutes): the expected times, with the setup,
    add up to at most the budget (``plan``). The moe16b eager row is dropped (the compiled
    row, and the gpu tests' compiled-vs-eager check, cover the MoE on CUDA)."""
    eight_b = [*EIGHT_B_SHAPED, *TRAIN]
    one_b = [*ONE_B, *TRAIN, *COMPILE]
    return [
        Case(f"{EIGHT_B} bf16+compile", "train", 110, [*eight_b, *COMPILE], min_s=60, expected_s=80),
        Case(f"{EIGHT_B} float8+compile", "train", 100, [*eight_b, *FLOAT8], min_s=60, expected_s=80),
        Case(SAVE_CASE, "save", 70, [*ONE_B, *SAVE], min_s=40, expected_s=50),
        Case("flex vs dense SDPA, doc mask, 8k", "attention", 50, min_s=25, expected_s=35),
        Case(MOE_COMPILED, "train", 160, [*MOE, *COMPILE], profile=MOE_PROFILE, min_s=90, expected_s=110),
        Case("gpu tests (pytest -m gpu)", "tests", 150, min_s=60, expected_s=120),
        Case("1B FSDP all GPUs bf16+compile", "train", 120, one_b, nproc=0, min_gpus=2, min_s=60, expected_s=90),
        Case("1B TP=2 bf16+compile", "train", 120, [*one_b, "--distributed.tp=2"], 2, 2, min_s=60, expected_s=90),
    ]


def plan(budget_s: float = BUDGET_S, gpus: int = 1, setup_s: float = SETUP_S) -> list[dict[str, Any]]:
    """The schedule under `budget_s` without running anything: each case's minimum, expected
    time, cap, its start when every earlier case takes its expected time, and its start when
    every earlier one takes its cap (``worst_start_s``), and what that means for it."""
    rows: list[dict[str, Any]] = []
    at, worst = setup_s, setup_s
    for c in cases():
        row: dict[str, Any] = {"case": c.name, "min_s": c.min_s, "expected_s": c.expected_s, "cap_s": c.cap_s}
        if gpus < c.min_gpus:
            rows.append(
                {**row, "start_s": None, "worst_start_s": None, "verdict": f"not run here (needs {c.min_gpus} GPUs)"}
            )
            continue
        left, worst_left = budget_s - at, budget_s - worst
        if left < c.min_s:
            verdict = f"dropped: starts at {at:.0f} s with {max(left, 0):.0f} s left, under its minimum"
        elif worst_left >= c.min_s:
            verdict = "runs even if every earlier case takes its cap"
        elif left >= c.expected_s:
            verdict = "runs if the earlier cases take their expected time"
        else:
            verdict = f"at risk: {left:.0f} s left at its expected start, under its expected {c.expected_s} s"
        rows.append({**row, "start_s": at, "worst_start_s": worst, "verdict": verdict})
        if left >= c.min_s:
            at += min(c.expected_s, left)
        if worst_left >= c.min_s:
            worst += min(c.cap_s, worst_left)
    return rows


def format_plan(rows: list[dict[str, Any]], budget_s: float, gpus: int, setup_s: float = SETUP_S) -> str:
    head = f"{'case':<36}{'min s':>6}{'exp s':>6}{'cap s':>6}{'start':>7}{'worst':>7}  verdict"
    lines = [f"schedule under a budget of {budget_s:.0f} s on {gpus} GPU(s), setup {setup_s:.0f} s:", head]
    lines.append("-" * len(head))
    for r in rows:
        start = "-" if r["start_s"] is None else f"{r['start_s']:.0f}"
        worst = "-" if r["worst_start_s"] is None else f"{r['worst_start_s']:.0f}"
        lines.append(
            f"{r['case']:<36}{r['min_s']:>6}{r['expected_s']:>6}{r['cap_s']:>6}{start:>7}{worst:>7}  {r['verdict']}"
        )
    run = [r for r in rows if r["start_s"] is not None and not r["verdict"].startswith("dropped")]
    end = setup_s + sum(r["expected_s"] for r in run)
    lines.append(
        f"expected end {end:.0f} s of {budget_s:.0f} s; caps of the cases run add up to {sum(r['cap_s'] for r in run)} s"
    )
    return "\n".join(lines)


def head_flop_share(model: Any, seq_len: int) -> float:
    """The output head's share of a token's training FLOPs (kforge's MFU convention)."""
    from kforge_cli.engine.model import flops_per_token

    return 6 * model.dim * model.vocab_size / flops_per_token(model, seq_len)


# ---------------------------------------------------------------- one case (worker side)


def fitted_overrides(case: Case, gpu_gib: float) -> tuple[list[str], str | None]:
    """The 8B-shaped cases on a GPU under ``BIG_GPU_GIB`` (an H100's 80 GB): 8 of Llama-3-8B's 32 blocks
    and a quarter of its vocabulary, the same FLOP mix (head 6.5%). kforge's planner puts the 16-block
    shape at 86.6 GiB on one GPU (AdamW, no activation checkpointing), the 8-block one at 44.3 GiB."""
    if not case.name.startswith(EIGHT_B) or gpu_gib >= BIG_GPU_GIB:
        return case.overrides, None
    layers = EIGHT_B_LAYERS // 2
    vocab = LLAMA3_8B_VOCAB * layers // LLAMA3_8B["n_layers"]
    note = f"{layers} of 32 blocks, vocab {vocab}: 16 need ~87 GiB, this GPU has {gpu_gib:.0f}"
    return [*case.overrides, f"--model.n_layers={layers}", f"--model.vocab_size={vocab}"], note


def train_case(case: Case, steps: int = 12, warmup: int = 6) -> dict[str, Any]:
    """tokens/s (median step after warm-up), MFU over every GPU's bf16 peak, steady-state peak memory."""
    import torch
    import torch.distributed as dist

    from kforge_cli.engine.model import flops_per_token
    from kforge_cli.engine.observe import device_peak_flops
    from kforge_cli.engine.train import StepInfo, TrainHook, run_training
    from kforge_cli.settings import load_settings

    class Clock(TrainHook):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.loss = float("nan")

        def on_train_begin(self, session: object) -> None:
            torch.cuda.synchronize()
            self.times = [time.perf_counter()]

        def on_step_end(self, session: object, info: StepInfo) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            self.loss = info.loss

    overrides, note = fitted_overrides(case, torch.cuda.get_device_properties(0).total_memory / 2**30)
    with tempfile.TemporaryDirectory() as tmp:
        run = [f"--train.max_steps={steps}", f"--train.run_dir={tmp}"]
        s = load_settings(case.profile, overrides=[*overrides, *run]).settings
        clock = Clock()
        run_training(s, hooks=[clock])  # kforge resets the peak-memory window after step 1
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // s.distributed.tp
    step_s = statistics.median(b - a for a, b in zip(clock.times[warmup:], clock.times[warmup + 1 :], strict=False))
    tokens = s.train.batch_size * s.train.seq_len * s.train.grad_accum_steps * dp
    tps = tokens / step_s
    peak = device_peak_flops(torch.device("cuda"), "bf16", None)
    return {
        "tokens_per_s": tps,
        "mfu": flops_per_token(s.model, s.train.seq_len) * tps / (peak * world) if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "step_s": step_s,
        "warmup_s": clock.times[warmup] - clock.times[0],
        "final_loss": clock.loss,
        "head_flop_share": head_flop_share(s.model, s.train.seq_len),
        "gpus": world,
        "n_layers": s.model.n_layers,
        "note": note,
    }


SMALL_CUDA = [  # the resume check: small, eager, the case's async mode (as tests/distributed/test_gpu.py's GPU dims)
    "--model.dim=256",
    "--model.n_layers=2",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.vocab_size=512",
    "--model.max_seq_len=64",
    "--train.seq_len=64",
    "--train.batch_size=4",
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
    "--eval.interval=0",
    "--metrics.progress_bar=off",
    "--data.num_workers=0",
    "--checkpoint.async_mode=async_with_pinned_mem",
]


def dd_write(directory: Path, nbytes: int) -> dict[str, float]:
    """``dd`` of `nbytes` (whole MiB) of zeros with fsync into `directory`, deleted after: the disk's write MB/s."""
    mb = max(1, nbytes // 2**20)
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mb}", "conv=fsync"]
    subprocess.run(cmd, check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    target.unlink()
    return {"dd_mb": float(mb), "dd_s": seconds, "dd_mb_per_s": mb / seconds}


def _losses_and_times(
    profile: str | None, overrides: list[str], extra_hooks: list[Any] | None = None
) -> tuple[dict[int, float], list[float], Any]:
    """One run_training: {step: loss}, the wall time at the start and after every step (device-synced), settings."""
    import torch

    from kforge_cli.engine.train import StepInfo, TrainHook, run_training
    from kforge_cli.settings import load_settings

    s = load_settings(profile, overrides=overrides).settings
    sync = torch.cuda.synchronize if s.train.device == "cuda" else (lambda: None)

    class Clock(TrainHook):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: dict[int, float] = {}

        def on_train_begin(self, session: object) -> None:
            sync()
            self.times = [time.perf_counter()]

        def on_step_end(self, session: object, info: StepInfo) -> None:
            sync()
            self.times.append(time.perf_counter())
            self.losses[info.step] = info.loss

    clock = Clock()
    run_training(s, hooks=[clock, *(extra_hooks or [])])
    return clock.losses, clock.times, s


def save_case(
    case: Case, steps: int = 8, interval: int = 5, small: list[str] | None = None, small_steps: int = 8
) -> dict[str, Any]:
    """An async save at a size the disk holds, and a resume equal to the uninterrupted run.

    The ~1B model (eager) saves at step `interval` (and, if the case asks, at the end): the
    loop's blocked time per save against the median step time of the steps without a save,
    and the save's MB/s (tensor bytes until durable) against ``dd`` of the same size into the
    same directory, run (and deleted) before the save. Then, small and without compile (`small`): `small_steps`
    uninterrupted steps against half of them, a save, and a resumed run of the rest."""
    import gc

    import torch

    from kforge_cli.engine.observe.metrics_file import iter_metrics
    from kforge_cli.rundir.names import METRICS_FILE
    from kforge_cli.settings import load_settings

    row: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kforge-gpu-save-", dir=os.environ.get("KFORGE_GPU_SAVE_DIR")) as tmp:
        root = Path(tmp)
        run = [*case.overrides, f"--train.max_steps={steps}", f"--checkpoint.interval={interval}"]
        run.append(f"--train.run_dir={root / 'run'}")
        s = load_settings(case.profile, overrides=run).settings
        estimate = s.model.param_count() * 12  # fp32 weights and AdamW's two moments
        row.update(dd_write(root, estimate))
        losses, times, s = _losses_and_times(case.profile, run)
        cuda = s.train.device == "cuda"
        saves = [r for r in iter_metrics(root / "run" / METRICS_FILE) if "checkpoint/bytes" in r]
        save_steps = {int(r["step"]) for r in saves}  # type: ignore[call-overload]
        step_s = [b - a for a, b in itertools.pairwise(times)]
        plain = [t for n, t in enumerate(step_s, start=1) if n > 2 and n not in save_steps] or step_s
        row["step_s"] = statistics.median(plain)
        row["tokens_per_s"] = s.train.batch_size * s.train.seq_len * s.train.grad_accum_steps / row["step_s"]
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        first = min(saves, key=lambda r: int(r["step"])) if saves else None  # type: ignore[call-overload]
        if first is None:
            return {**row, "status": "failed (no save recorded in metrics.jsonl)"}
        row["saves"] = len(saves)
        row["save_bytes"] = first["checkpoint/bytes"]
        row["save_s"] = first["checkpoint/seconds"]
        row["save_mb_per_s"] = first["checkpoint/mb_per_s"]
        row["blocked_s"] = first["checkpoint/blocked_s"]
        row["blocked_over_step"] = float(first["checkpoint/blocked_s"]) / row["step_s"]  # type: ignore[arg-type]
        mb_per_s = row["save_mb_per_s"]
        row["save_over_dd"] = float(mb_per_s) / row["dd_mb_per_s"] if isinstance(mb_per_s, int | float) else None
        row["final_loss"] = losses.get(max(losses)) if losses else None
    del s
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    row.update(resume_check(SMALL_CUDA if small is None else small, small_steps))
    row["status"] = "ok" if row["resume_equal"] else f"failed (resume differs by {row['resume_max_rel_diff']:.2e})"
    return row


def resume_check(small: list[str], steps: int, rel: float = 1e-5) -> dict[str, Any]:
    """`steps` uninterrupted against a run stopped by SIGTERM after steps/2 (its save in the run's
    async mode) and resumed to `steps`: the resumed steps' losses, relative difference at most `rel`."""
    half = steps // 2
    with tempfile.TemporaryDirectory(prefix="kforge-gpu-resume-") as tmp:
        base = [*small, f"--train.max_steps={steps}", "--checkpoint.interval=0"]
        want, _, _ = _losses_and_times(None, [*base, "--checkpoint.save_final=false", f"--train.run_dir={tmp}/once"])
        cut = [*base, f"--train.run_dir={tmp}/cut"]
        _losses_and_times(None, cut, [sigterm_after(half)])
        got, _, _ = _losses_and_times(None, [*cut, "--checkpoint.resume=require"])
    diffs = [abs(got[n] - want[n]) / max(abs(want[n]), 1e-12) for n in range(half + 1, steps + 1) if n in got]
    ok = sorted(got) == list(range(half + 1, steps + 1)) and max(diffs, default=1.0) <= rel
    return {"resume_equal": ok, "resume_max_rel_diff": max(diffs, default=float("nan")), "resume_steps": sorted(got)}


def sigterm_after(step: int) -> Any:
    """A train hook sending this process SIGTERM after `step` (a preemption: kforge saves and stops)."""
    import signal

    from kforge_cli.engine.train import StepInfo, TrainHook

    class SigtermAfter(TrainHook):
        def on_step_end(self, session: object, info: StepInfo) -> None:
            if info.step == step:
                os.kill(os.getpid(), signal.SIGTERM)

    return SigtermAfter()


# ---------------------------------------------------------------- the run (driver side)


def run_subprocess(
    cmd: list[str], timeout_s: float, row_file: Path | None, log_file: Path, interrupt_first: bool = False
) -> dict[str, Any]:
    """Run one case's command; its row from ``row_file``, or a failure row (exit code / timeout + log tail).

    ``interrupt_first``: a timed-out command gets SIGINT first (pytest then still writes its report)."""
    t0 = time.perf_counter()
    with log_file.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _kill_group(proc, interrupt_first)
    row: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1)}
    if code is None:
        return {**row, "status": f"timeout after {timeout_s:.0f} s", "log_tail": _tail(log_file)}
    if code != 0:
        return {**row, "status": f"failed (exit {code})", "exit_code": code, "log_tail": _tail(log_file)}
    if row_file is not None:
        if not row_file.is_file():
            return {**row, "status": "failed (no result written)", "log_tail": _tail(log_file)}
        row.update(json.loads(row_file.read_text()))
    return {**row, "status": row.get("status", "ok")}


def _kill_group(proc: subprocess.Popen[bytes], interrupt_first: bool = False) -> None:
    """End a timed-out case with everything it started (torchrun's workers, pytest's launches)."""
    import signal

    steps = [(signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)]
    if interrupt_first:
        steps.insert(0, (signal.SIGINT, 10.0))
    for sig, wait in steps:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


# ---------------------------------------------------------------- the gpu tests row

NEEDS_GPUS = re.compile(r"needs (\d+) GPUs")
PARITY_TEST = "compile_with_tensor_parallel"
# Cheap tests first (unit), the launches and compiles last: a row cut short has run the most tests.
TEST_DIRS = ("tests/unit", "tests/data", "tests/e2e", "tests/slurm", "tests/distributed")
_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?")
_SELECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?")


def session_timeout_supported() -> bool:
    """pytest-timeout >= 2.3 has ``--session-timeout`` (stop starting tests after that long)."""
    import importlib.metadata as md

    try:
        major, minor = (int(x) for x in md.version("pytest-timeout").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (2, 3)


def tests_command(junit: Path, timeout_s: float, session_timeout: bool) -> list[str]:
    """pytest -m gpu, verbose (the log is read when no report is written), per-test and session limits."""
    per_test = int(max(30, min(TEST_LIMIT_S, timeout_s - 10)))
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", f"--timeout={per_test}"]
    if session_timeout:
        cmd.append(f"--session-timeout={max(10, int(timeout_s - TESTS_STOP_S))}")
    return [*cmd, f"--junitxml={junit}", *(d for d in TEST_DIRS if (REPO / d).is_dir())]


def _outcome(counts: dict[str, Any], name: str, outcome: str, detail: str) -> None:
    needs = NEEDS_GPUS.search(detail) if outcome == "skipped" else None
    key = "not_run_here" if needs else outcome
    counts[key] += 1
    if needs:
        counts["needs_gpus"] = max(counts.get("needs_gpus", 0), int(needs.group(1)))
    if outcome == "failed":
        counts["failed_tests"].append(f"{name}: {detail[:120]}")
    if PARITY_TEST in name:
        counts["compile_tp_parity"] = (
            f"not run here (needs {needs.group(1)} GPUs)"
            if needs
            else outcome + (f" ({detail[:120]})" if detail else "")
        )


def _new_counts() -> dict[str, Any]:
    return {
        "passed": 0,
        "failed": 0,
        "skipped": 0,
        "not_run_here": 0,
        "failed_tests": [],
        "compile_tp_parity": "not run",
    }


def _finish(counts: dict[str, Any]) -> dict[str, Any]:
    if not counts["failed_tests"]:
        counts.pop("failed_tests")
    counts["status"] = "ok" if counts["failed"] == 0 else "failed"
    return counts


def summarise_junit(path: Path) -> dict[str, Any]:
    """Counts of the gpu tests, the failed tests' names, and the compile + TP parity test's outcome.

    Skips for want of GPUs ("needs N GPUs") are counted apart (``not_run_here``)."""
    if not path.is_file():
        return {"status": "failed (no junit report)"}
    counts = _new_counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                detail = el.get("message") or ""
        _outcome(counts, case.get("name", ""), outcome, detail)
    return _finish(counts)


def summarise_log(path: Path) -> dict[str, Any]:
    """The same counts read from pytest's streamed ``-v`` log (for a run killed before its report)."""
    counts = _new_counts()
    text = path.read_text(errors="replace") if path.is_file() else ""
    selected = None
    for line in text.splitlines():
        if m := _SELECTED.search(line):
            total, deselected, chosen = (int(g) if g else None for g in m.groups())
            selected = chosen if chosen is not None else (total or 0) - (deselected or 0)
        elif m := _VERBOSE.match(line):
            name, word, detail = m.group(1), m.group(2), m.group(3) or ""
            outcome = {"PASSED": "passed", "XPASS": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(
                word, "failed"
            )
            _outcome(counts, name.rsplit("::", 1)[-1], outcome, detail)
    counts = _finish(counts)
    if selected is not None:
        ran = counts["passed"] + counts["failed"] + counts["skipped"] + counts["not_run_here"]
        counts["not_reached"] = max(selected - ran, 0)
    return counts


def tests_row(result: dict[str, Any], junit: Path, log: Path) -> dict[str, Any]:
    """The tests row whatever happened: the report's counts, else the log's; a cut run says so."""
    counts = summarise_junit(junit) if junit.is_file() else {**summarise_log(log), "counts_from": "the -v log"}
    status = result["status"]
    if status.startswith("timeout"):
        counts["status"] = f"{status}, counts of the tests that ran"
    elif "session-timeout" in _tail(log, 4000):  # pytest-timeout stopped starting tests
        counts["status"] += " (session time up: later tests not run)"
    elif result.get("exit_code") not in (None, 0, 1):
        counts["status"] = f"{status}; {counts['status']}"
    return {**result, **counts}


# ---------------------------------------------------------------- commands and the schedule


def case_command(case: Case, gpus: int, row_file: Path, junit: Path, timeout_s: float) -> list[str]:
    py = sys.executable
    if case.kind == "tests":
        return tests_command(junit, timeout_s, session_timeout_supported())
    if case.kind == "attention":
        attention = REPO / "bench" / "attention_speed.py"
        return [py, str(attention), "--seq-len", "8192", "--steps", "10", "--out", str(row_file)]
    nproc = gpus if case.nproc == 0 else case.nproc
    if nproc == 1:
        return [py, __file__, "case", case.name, "--out", str(row_file)]
    run = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*run, __file__, "case", case.name, "--out", str(row_file)]


def attention_row(raw: dict[str, Any]) -> dict[str, Any]:
    """bench/attention_speed.py's JSON as a table row: flex tokens/s and its ratio to dense-mask SDPA."""
    backends = raw.get("backends", {})
    return {
        "status": raw.get("status", "ok"),
        "tokens_per_s": backends.get("flex", {}).get("tokens_per_s"),
        "dense_tokens_per_s": backends.get("sdpa_dense", {}).get("tokens_per_s"),
        "flex_over_dense": raw.get("flex_over_dense"),
        "peak_mem_gib": backends.get("flex", {}).get("peak_mem_gib"),
        "seconds": raw.get("seconds"),
    }


def start_decision(case: Case, left: float, gpus: int) -> str | None:
    """Why `case` is not started with `left` seconds to the deadline, or None to start it."""
    if gpus < case.min_gpus:
        return f"skipped: needs {case.min_gpus} GPUs, found {gpus}"
    if left < case.min_s:
        return f"skipped: {max(left, 0):.0f} s left, under its minimum of {case.min_s} s"
    return None


def run_all(
    deadline: float,
    out_dir: Path,
    gpus: int,
    device: str,
    *,
    run_case: Callable[[Case, float, Path, Path], dict[str, Any]] | None = None,
    clock: Callable[[], float] = time.time,
) -> list[dict[str, Any]]:
    """Every case in order until `deadline` (``clock()`` seconds); the rows, also in out_dir.

    A case starts only with at least its ``min_s`` left, and gets ``min(cap_s, left)``.
    ``run_case(case, timeout_s, log, junit)`` runs one (default: its command in a subprocess)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kforge-gpu-acceptance-"))
    logs, junit = out_dir / "logs.txt", out_dir / "gpu-tests.xml"
    logs.write_text("")
    junit.unlink(missing_ok=True)  # a report left by an earlier run is not this run's

    def subprocess_case(case: Case, timeout: float, log: Path, junit: Path) -> dict[str, Any]:
        row_file = log.with_suffix(".json")
        cmd = case_command(case, gpus, row_file, junit, timeout)
        if case.kind == "tests":
            return tests_row(run_subprocess(cmd, timeout, None, log, interrupt_first=True), junit, log)
        result = run_subprocess(cmd, timeout, row_file, log)
        if case.kind == "attention" and result["status"] == "ok":
            result = {**attention_row(result), "seconds": result["seconds"]}
        return result

    run_one = run_case or subprocess_case
    try:
        rows = _run_cases(deadline, gpus, run_one, clock, work, logs, junit)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the cases' logs are in logs.txt by now
    write_results(rows, out_dir / "results.json", {"device": device, "gpus": gpus})
    return rows


def _run_cases(
    deadline: float,
    gpus: int,
    run_one: Callable[[Case, float, Path, Path], dict[str, Any]],
    clock: Callable[[], float],
    work: Path,
    logs: Path,
    junit: Path,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    start = clock()
    for i, case in enumerate(cases()):
        row: dict[str, Any] = {"case": case.name, "expected_s": case.expected_s}
        left = deadline - clock()
        skip = start_decision(case, left, gpus)
        if skip is not None:
            row["status"] = skip
        else:
            log = work / f"{i}.log"
            row.update(run_one(case, min(case.cap_s, left), log, junit))
            with logs.open("a") as f:
                f.write(f"\n===== {case.name}: {row['status']} ({row.get('seconds')} s)\n")
                f.write(log.read_text(errors="replace")[-40_000:] if log.is_file() else "")
        rows.append(row)
        print(f"[{clock() - start:5.0f} s] {case.name}: {row['status']}", flush=True)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _tests_status(r: dict[str, Any]) -> str:
    out = f": {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
    if r.get("not_run_here"):
        out += f", {r['not_run_here']} not run here (needs {r.get('needs_gpus', 2)} GPUs)"
    if r.get("not_reached"):
        out += f", {r['not_reached']} not reached"
    if r.get("counts_from"):
        out += f" (counts from {r['counts_from']})"
    return out + f"; compile+TP parity vs eager: {r.get('compile_tp_parity')}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The one table: tokens/s, MFU, peak GiB, seconds (and expected), and the status with each kind's figures."""
    head = f"{'case':<36}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'s':>7}{'exp s':>7}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        status = r.get("status", "")
        if "passed" in r:
            status += _tests_status(r)
        if r.get("flex_over_dense") is not None:
            status += f" (flex/dense = {r['flex_over_dense']:.2f}x, dense {_fmt(r.get('dense_tokens_per_s'), ',.0f')})"
        if r.get("head_flop_share") is not None:
            status += f" (head {r['head_flop_share']:.1%} of FLOPs)"
        if r.get("note"):
            status += f" [{r['note']}]"
        if r.get("blocked_over_step") is not None:
            status += (
                f" (blocked {r['blocked_s']:.2f} s/save = {r['blocked_over_step']:.2f} steps;"
                f" save {_fmt(r.get('save_mb_per_s'), ',.0f')} MB/s = {_fmt(r.get('save_over_dd'), '.2f')}x dd;"
                f" resume equal: {r.get('resume_equal')})"
            )
        lines.append(
            f"{r['case']:<36}{_fmt(r.get('tokens_per_s'), ',.0f'):>12}{_fmt(r.get('mfu'), '.1%'):>8}"
            f"{_fmt(r.get('peak_mem_gib'), '.1f'):>10}{_fmt(r.get('seconds'), '.0f'):>7}"
            f"{_fmt(r.get('expected_s'), '.0f'):>7}  {status}"
        )
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2))


def json_table(rows: list[dict[str, Any]]) -> str:
    """The rows without their log tails (those are in logs.txt), one JSON document."""
    return json.dumps([{k: v for k, v in r.items() if k != "log_tail"} for r in rows], indent=1)


# ---------------------------------------------------------------- versions


# Metrics backends the cases do not turn on (bench/gpu/closure.py's OPTIONAL): not carried, not reported.
NOT_USED_HERE = {"wandb", "mlflow", "mlflow-skinny"}
VERSIONS = ("torch", "triton", "torchao", "numpy", "pydantic", "pydantic-settings", "typer", "rich", "pytest")


def versions() -> tuple[list[str], list[str]]:
    """Lines naming the versions that matter, and pyproject requirements this environment does not meet."""
    import importlib.metadata as md
    import platform
    import tomllib

    from packaging.requirements import Requirement

    lines = [f"python {platform.python_version()} ({sys.executable})"]
    for name in VERSIONS:
        try:
            lines.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            lines.append(f"{name} -")
    try:
        import torch

        cuda = torch.cuda.is_available()
        gpu = f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}" if cuda else "no CUDA device"
        lines.append(f"cuda {torch.version.cuda}, {gpu}")
    except Exception as exc:
        lines.append(f"torch: {exc}")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    unmet: list[str] = []
    for spec in [*project["dependencies"], *project["optional-dependencies"]["float8"]]:
        req = Requirement(spec)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None and re.sub(r"[-_.]+", "-", req.name).lower() in NOT_USED_HERE:
            continue
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            unmet.append(f"{spec} (found {have or 'none'})")
    return lines, unmet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--deadline", type=float, help="time.time() by which every case has ended")
    run.add_argument("--budget-s", type=float, default=BUDGET_S, help="from now, without --deadline")
    run.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    schedule = sub.add_parser("plan", help="print the schedule; runs nothing, needs no CUDA")
    schedule.add_argument("--budget-s", type=float, default=BUDGET_S)
    schedule.add_argument("--gpus", type=int, default=1)
    schedule.add_argument("--setup-s", type=float, default=SETUP_S, help="spent before the first case")
    one = sub.add_parser("case")
    one.add_argument("name")
    one.add_argument("--out", type=Path, required=True)
    sub.add_parser("versions")
    args = parser.parse_args(argv)
    if args.cmd == "plan":
        print(format_plan(plan(args.budget_s, args.gpus, args.setup_s), args.budget_s, args.gpus, args.setup_s))
        return 0
    if args.cmd == "versions":
        lines, unmet = versions()
        print("\n".join(lines))
        for u in unmet:
            print(f"NOT MET (kforge's pyproject): {u}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu/acceptance.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cmd == "case":
        case = next(c for c in cases() if c.name == args.name)
        row = save_case(case) if case.kind == "save" else train_case(case)
        if int(os.environ.get("RANK", "0")) == 0:
            args.out.write_text(json.dumps(row))
        return 0
    deadline = args.deadline if args.deadline is not None else time.time() + args.budget_s
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name()
    rows = run_all(deadline, args.out_dir, gpus, name)
    print(f"\n{name} x {gpus}\n{format_table(rows)}\nwrote {args.out_dir}\n{json_table(rows)}")
    return 0 if all(not r["status"].startswith(("failed", "timeout")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
