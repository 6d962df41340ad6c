"""GPU acceptance cases (driven by bench/gpu/run): one table of what a GPU machine can show.

Rows, in order of value, under one shared deadline (a case starts only with time left, and
its own cap is cut to what is left; a case that fails, times out or is out of time is a
row saying so, never an abort):

1. an 8B-shaped model at bf16 + compile: Llama-3-8B's block (dim 4096, GQA 32/8, FFN
   14336) with 16 of its 32 blocks and half its vocabulary, so the output head's share of
   the training FLOPs is the full 8B's (6.5% at 2k tokens; 4 blocks with the full
   vocabulary would put 36% there and its MFU would not represent an 8B);
2. a moe16b-shaped MoE (4 blocks, one GPU holds every expert): bf16 grouped GEMM, eager,
   then compiled;
3. FlexAttention vs dense-mask SDPA with document masking at 8k tokens
   (bench/attention_speed.py);
4. the ``gpu``-marked tests (counts; compile + TP parity from them);
5. the 8B-shaped model at float8 + compile;
6. with 2+ GPUs: FSDP over every GPU and TP = 2 (rows saying "needs 2 GPUs" on one).

Train rows: tokens/s (median step after warm-up, each step timed to a device sync), MFU
over the GPU's bf16 peak, steady-state peak memory. Writes at most three files to the
output directory: results.json (the rows), logs.txt (every case's output) and
gpu-tests.xml (the tests' JUnit report); prints the table, then the rows as JSON, last.

    python bench/gpu/acceptance.py run --out-dir DIR [--deadline EPOCH_S | --budget-s S]
    python bench/gpu/acceptance.py case NAME --out ROW.json     # one case (what `run` starts)
    python bench/gpu/acceptance.py versions                     # what bench/gpu/run prints first
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
REPO = HERE.parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "gpu"
BUDGET_S = 500.0  # everything bench/gpu/run does, install included, fits one 9-minute command
MIN_START_S = 30.0  # a case with less time left than this is not started

LLAMA3_8B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden_dim": 14336}
LLAMA3_8B_VOCAB = 128256
EIGHT_B_LAYERS = 16
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


@dataclass
class Case:
    """One row: a training run (``overrides``), the attention bench, or the gpu tests."""

    name: str
    kind: str  # "train" | "attention" | "tests"
    cap_s: int  # the most this case may take (less when the deadline is nearer)
    overrides: list[str] = field(default_factory=list)
    nproc: int = 1  # 0: every GPU
    min_gpus: int = 1
    profile: str | None = None


def cases() -> list[Case]:
    """In order of value: what runs first is what a short budget still shows."""
    return [
        Case(f"{EIGHT_B} bf16+compile", "train", 160, [*EIGHT_B_SHAPED, *TRAIN, *COMPILE]),
        Case("moe16b-shaped/4L bf16", "train", 70, MOE, profile=MOE_PROFILE),
        Case("moe16b-shaped/4L bf16+compile", "train", 130, [*MOE, *COMPILE], profile=MOE_PROFILE),
        Case("flex vs dense SDPA, doc mask, 8k", "attention", 100),
        Case("gpu tests (pytest -m gpu)", "tests", 200),
        Case(f"{EIGHT_B} float8+compile", "train", 150, [*EIGHT_B_SHAPED, *TRAIN, *FLOAT8]),
        Case("1B FSDP all GPUs bf16+compile", "train", 180, [*ONE_B, *TRAIN, *COMPILE], nproc=0, min_gpus=2),
        Case("1B TP=2 bf16+compile", "train", 180, [*ONE_B, *TRAIN, *COMPILE, "--distributed.tp=2"], 2, 2),
    ]


def head_flop_share(model: Any, seq_len: int) -> float:
    """The output head's share of a token's training FLOPs (kforge's MFU convention)."""
    from kforge_cli.engine.model import flops_per_token

    return 6 * model.dim * model.vocab_size / flops_per_token(model, seq_len)


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
        "head_flop_share": head_flop_share(s.model, s.train.seq_len),
        "gpus": world,
    }


# ---------------------------------------------------------------- the run (driver side)


def run_subprocess(cmd: list[str], timeout_s: float, row_file: Path | None, log_file: Path) -> dict[str, Any]:
    """Run one case's command; its row from ``row_file``, or a failure row (exit code / timeout + log tail)."""
    t0 = time.perf_counter()
    with log_file.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _kill_group(proc)
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


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End a timed-out case with everything it started (torchrun's workers, pytest's launches)."""
    import signal

    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
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


def summarise_junit(path: Path) -> dict[str, Any]:
    """Counts of the gpu tests, the failed tests' names, and the compile + TP parity test's outcome."""
    if not path.is_file():
        return {"status": "failed (no junit report)"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    parity = "not run"
    failed: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                detail = (el.get("message") or "")[:120]
        counts[outcome] += 1
        if outcome == "failed":
            failed.append(f"{case.get('name')}: {detail}")
        if "compile_with_tensor_parallel" in case.get("name", ""):
            parity = outcome + (f" ({detail})" if detail else "")
    out: dict[str, Any] = {**counts, "compile_tp_parity": parity}
    out["status"] = "ok" if counts["failed"] == 0 else "failed"
    if failed:
        out["failed_tests"] = failed
    return out


def case_command(case: Case, gpus: int, row_file: Path, junit: Path, timeout_s: float) -> list[str]:
    py = sys.executable
    if case.kind == "tests":
        per_test = max(30, int(timeout_s * 0.6))  # one hanging test leaves time for the others
        pytest = [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--timeout={per_test}"]
        return [*pytest, f"--junitxml={junit}", "tests"]
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


def run_all(deadline: float, out_dir: Path, gpus: int, device: str) -> list[dict[str, Any]]:
    """Every case in order until `deadline` (``time.time()`` seconds); the rows, also in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kforge-gpu-acceptance-"))
    logs, junit = out_dir / "logs.txt", out_dir / "gpu-tests.xml"
    logs.write_text("")
    rows: list[dict[str, Any]] = []
    start = time.time()
    for i, case in enumerate(cases()):
        row: dict[str, Any] = {"case": case.name}
        left = deadline - time.time()
        if gpus < case.min_gpus:
            row["status"] = f"skipped: needs {case.min_gpus} GPUs, found {gpus}"
        elif left < MIN_START_S:
            row["status"] = f"skipped: out of time ({max(left, 0):.0f} s left)"
        else:
            timeout = min(case.cap_s, left)
            row_file, log = work / f"{i}.json", work / f"{i}.log"
            cmd = case_command(case, gpus, row_file, junit, timeout)
            result = run_subprocess(cmd, timeout, None if case.kind == "tests" else row_file, log)
            if case.kind == "tests" and not result["status"].startswith("timeout"):
                result = {**result, **summarise_junit(junit)}
            elif case.kind == "attention" and result["status"] == "ok":
                result = {**attention_row(result), "seconds": result["seconds"]}
            row.update(result)
            with logs.open("a") as f:
                f.write(f"\n===== {case.name}: {row['status']} ({row.get('seconds')} s)\n")
                f.write(log.read_text(errors="replace")[-40_000:] if log.is_file() else "")
        rows.append(row)
        print(f"[{time.time() - start:5.0f} s] {case.name}: {row['status']}", flush=True)
    write_results(rows, out_dir / "results.json", {"device": device, "gpus": gpus})
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
        if r.get("head_flop_share") is not None:
            status += f" (head {r['head_flop_share']:.1%} of FLOPs)"
        lines.append(
            f"{r['case']:<36}{_fmt(r.get('tokens_per_s'), ',.0f'):>12}{_fmt(r.get('mfu'), '.1%'):>8}"
            f"{_fmt(r.get('peak_mem_gib'), '.1f'):>10}{_fmt(r.get('seconds'), '.0f'):>7}  {status}"
        )
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2))


def json_table(rows: list[dict[str, Any]]) -> str:
    """The rows without their log tails (those are in logs.txt), one JSON document."""
    return json.dumps([{k: v for k, v in r.items() if k != "log_tail"} for r in rows], indent=1)


# ---------------------------------------------------------------- versions


NOT_USED_HERE = {"wandb", "mlflow"}  # metrics backends the cases do not turn on (bench/gpu/closure.py)
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
        if have is None and req.name in NOT_USED_HERE:
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
    one = sub.add_parser("case")
    one.add_argument("name")
    one.add_argument("--out", type=Path, required=True)
    sub.add_parser("versions")
    args = parser.parse_args(argv)
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
        row = train_case(case)
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
