"""GPU acceptance (driver of bench/gpu_acceptance.sh): one table of what a GPU machine can show.

Rows: the ``gpu``-marked tests (counts, and compile + TP parity against eager from them);
tokens/s, MFU and steady-state peak memory of a ~1B and an 8B-shaped model (4 of its 32
blocks, to fit the time) at bf16, bf16 + compile and float8 + compile, plus FSDP and TP=2
with 2+ GPUs; a moe16b-shaped MoE (4 blocks); FlexAttention vs dense-mask SDPA with
document masking at 8k tokens (bench/attention_speed.py). Every case runs in its own
subprocess with its own timeout, inside an overall budget; a case that fails, times out
or is out of budget is a row saying so, never an abort. Writes
bench/results/gpu_acceptance.json.

    python bench/gpu_acceptance.py run [--budget-s 450] [--out PATH]
    python bench/gpu_acceptance.py case NAME --out ROW.json     # one case (what `run` starts)
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
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results" / "gpu_acceptance.json"

ONE_B = [  # ~1.0B parameters, as bench/single_gpu_throughput.py
    "--model.dim=2048",
    "--model.n_layers=18",
    "--model.n_heads=16",
    "--model.n_kv_heads=8",
    "--model.vocab_size=32768",
    "--model.max_seq_len=2048",
    "--train.batch_size=4",
]
EIGHT_B_SHAPED = [  # Llama-3-8B's block and vocabulary, 4 of its 32 blocks
    "--model.dim=4096",
    "--model.n_layers=4",
    "--model.n_heads=32",
    "--model.n_kv_heads=8",
    "--model.ffn_hidden_dim=14336",
    "--model.vocab_size=128256",
    "--model.max_seq_len=2048",
    "--train.batch_size=2",
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


@dataclass
class Case:
    """One row: a training run (``overrides``), the attention bench, or the gpu tests."""

    name: str
    kind: str  # "train" | "attention" | "tests"
    timeout_s: int
    overrides: list[str] = field(default_factory=list)
    nproc: int = 1  # 0: every GPU
    min_gpus: int = 1
    profile: str | None = None


def cases() -> list[Case]:
    """In order of importance: what runs first is what a short budget still shows."""
    out = [Case("gpu tests (pytest -m gpu)", "tests", 200)]
    for model, shape in (("1B", ONE_B), ("8B-shaped/4L", EIGHT_B_SHAPED)):
        out += [
            Case(f"{model} bf16", "train", 90, [*shape, *TRAIN]),
            Case(f"{model} bf16+compile", "train", 150, [*shape, *TRAIN, *COMPILE]),
            Case(f"{model} float8+compile", "train", 150, [*shape, *TRAIN, *FLOAT8]),
        ]
    out += [
        Case("moe16b-shaped/4L bf16", "train", 150, MOE, profile=MOE_PROFILE),
        Case("flex vs dense SDPA, doc mask, 8k", "attention", 150),
        Case("1B FSDP all GPUs bf16+compile", "train", 180, [*ONE_B, *TRAIN, *COMPILE], nproc=0, min_gpus=2),
        Case("1B TP=2 bf16+compile", "train", 180, [*ONE_B, *TRAIN, *COMPILE, "--distributed.tp=2"], 2, 2),
    ]
    return out


# ---------------------------------------------------------------- one case (worker side)


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

    with tempfile.TemporaryDirectory() as tmp:
        run = [f"--train.max_steps={steps}", f"--train.run_dir={tmp}"]
        s = load_settings(case.profile, overrides=[*case.overrides, *run]).settings
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
        "gpus": world,
    }


# ---------------------------------------------------------------- the run (driver side)


def run_subprocess(cmd: list[str], timeout_s: float, row_file: Path | None, log_file: Path) -> dict[str, Any]:
    """Run one case's command; its row from ``row_file``, or a failure row (exit code / timeout + log tail)."""
    t0 = time.perf_counter()
    with log_file.open("w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    row: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1)}
    if code is None:
        return {**row, "status": f"timeout after {timeout_s:.0f} s", "log_tail": _tail(log_file)}
    if code != 0:
        return {**row, "status": f"failed (exit {code})", "log_tail": _tail(log_file)}
    if row_file is not None:
        if not row_file.is_file():
            return {**row, "status": "failed (no result written)", "log_tail": _tail(log_file)}
        row.update(json.loads(row_file.read_text()))
    return {**row, "status": row.get("status", "ok")}


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


def summarise_junit(path: Path) -> dict[str, Any]:
    """Counts of the gpu tests and the compile + TP parity test's outcome (with a skip's reason)."""
    if not path.is_file():
        return {"status": "failed (no junit report)"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    parity = "not run"
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                detail = (el.get("message") or "")[:120]
        counts[outcome] += 1
        if "compile_with_tensor_parallel" in case.get("name", ""):
            parity = outcome + (f" ({detail})" if detail else "")
    return {**counts, "compile_tp_parity": parity, "status": "ok" if counts["failed"] == 0 else "failed"}


def case_command(case: Case, gpus: int, row_file: Path, junit: Path) -> list[str]:
    py = sys.executable
    if case.kind == "tests":
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests"]
    if case.kind == "attention":
        return [py, str(HERE / "attention_speed.py"), "--seq-len", "8192", "--steps", "10", "--out", str(row_file)]
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
        "seconds": raw.get("seconds"),
    }


def run_all(budget_s: float, out: Path, gpus: int, device: str) -> list[dict[str, Any]]:
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kforge-gpu-acceptance-"))
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases()):
        row: dict[str, Any] = {"case": case.name}
        left = budget_s - (time.perf_counter() - start)
        if gpus < case.min_gpus:
            row["status"] = f"skipped: needs {case.min_gpus} GPUs, found {gpus}"
        elif left < 30:
            row["status"] = "skipped: out of the time budget"
        else:
            row_file, junit, log = work / f"{i}.json", work / "gpu_tests.xml", work / f"{i}.log"
            cmd = case_command(case, gpus, row_file, junit)
            result = run_subprocess(cmd, min(case.timeout_s, left), None if case.kind == "tests" else row_file, log)
            if case.kind == "tests" and not result["status"].startswith("timeout"):
                result = {**result, **summarise_junit(junit)}
            elif case.kind == "attention" and result["status"] == "ok":
                result = {**attention_row(result), "seconds": result["seconds"]}
            row.update(result)
        rows.append(row)
        print(f"[{time.perf_counter() - start:5.0f} s] {case.name}: {row['status']}", flush=True)
    write_results(rows, out, {"device": device, "gpus": gpus, "budget_s": budget_s, "logs": str(work)})
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The one table: tokens/s, MFU, peak GiB, and the status (or the tests' counts / parity)."""
    head = f"{'case':<36}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'s':>7}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        status = r.get("status", "")
        if "passed" in r:
            status += f": {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
            status += f"; compile+TP parity vs eager: {r.get('compile_tp_parity')}"
        if r.get("flex_over_dense") is not None:
            status += f" (flex/dense = {r['flex_over_dense']:.2f}x, dense {_fmt(r.get('dense_tokens_per_s'), ',.0f')})"
        lines.append(
            f"{r['case']:<36}{_fmt(r.get('tokens_per_s'), ',.0f'):>12}{_fmt(r.get('mfu'), '.1%'):>8}"
            f"{_fmt(r.get('peak_mem_gib'), '.1f'):>10}{_fmt(r.get('seconds'), '.0f'):>7}  {status}"
        )
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--budget-s", type=float, default=450.0)
    run.add_argument("--out", type=Path, default=DEFAULT_OUT)
    one = sub.add_parser("case")
    one.add_argument("name")
    one.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_acceptance needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cmd == "case":
        case = next(c for c in cases() if c.name == args.name)
        row = train_case(case)
        if int(os.environ.get("RANK", "0")) == 0:
            args.out.write_text(json.dumps(row))
        return 0
    gpus = torch.cuda.device_count()
    rows = run_all(args.budget_s, args.out, gpus, torch.cuda.get_device_name())
    print(f"\n{torch.cuda.get_device_name()} x {gpus}\n{format_table(rows)}\nwrote {args.out}")
    return 0 if all(not r["status"].startswith(("failed", "timeout")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
