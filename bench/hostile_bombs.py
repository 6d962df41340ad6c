"""Benchmark: peak RSS and wall time of memory/time-bomb inputs against an honest input of the same command.

Issue 29, class 7: what a file *claims* must not decide what kforge allocates or how long it
runs. A tiny run is trained once and exported to Hugging Face; each bomb is a copy whose
files claim something huge:

- ``generate`` on a kforge checkpoint whose shaping record claims vocab_size=1e9,
  max_seq_len=2**23 or n_layers=1e6, and on an HF directory whose config.json claims the same;
- ``inspect-ckpt --verify`` on a train state claiming world_size=300000;
- ``runs`` and ``plot`` on a 144 MB metrics.jsonl (one 16 MB line, then ~850k records);
- ``eval`` on a multiple-choice task with a 50 MB context;
- (issue 40) ``generate --prompt-file`` on a 1 GiB file, ``eval`` on a 1.5 KB lm-eval task YAML
  alias bomb, ``generate`` on Hugging Face configs claiming ERNIE-4.5-MoE with
  ``moe_layer_interval: 0`` or 1e12 layers.

Every command runs alone in a child process (peak RSS from ``os.wait4``, wall time around
it; a command still running after ``--timeout`` seconds is killed and reported). The honest
input of each command is the baseline; the target is a worst ratio <= 2 for both. Prints a
table and writes bench/results/hostile_bombs.json.

    python bench/hostile_bombs.py [--src OTHER/src] [--timeout 120]   # --src: measure another tree
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARGS = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=256",
    "--train.seq_len=64",
    "--train.batch_size=4",
    "--train.max_steps=2",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--checkpoint.interval=2",
    "--metrics.progress_bar=off",
    "--train.num_threads=1",
]
GENERATE = ["--prompt", "Once upon a time", "--max-new-tokens", "8", "--temperature", "0"]


def kforge() -> list[str]:
    exe = shutil.which("kforge", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "kforge_cli"]


def measure(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Peak RSS (MB), wall time (s) and exit code of `cmd` alone in a child process; killed after `timeout`."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    timed_out = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - start > timeout:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            timed_out = True
            break
        time.sleep(0.02)
    wall = time.monotonic() - start
    code = "timeout" if timed_out else os.waitstatus_to_exitcode(status)
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "wall_s": round(wall, 2), "exit": code}


def _claim_in_checkpoint(step: Path, claims: dict[str, int]) -> None:
    path = step / "train_state.json"
    state = json.loads(path.read_text())
    state["shaping"].update({f"model.{k}": v for k, v in claims.items()})
    path.write_text(json.dumps(state))


def _claim_in_hf(hf: Path, claims: dict[str, int]) -> None:
    path = hf / "config.json"
    config = json.loads(path.read_text())
    config.update(claims)
    path.write_text(json.dumps(config))


def _metrics(path: Path, records: int, huge_line_mb: int = 0) -> None:
    with path.open("wb") as f:
        if huge_line_mb:
            f.write(b'{"step": 0, "note": "' + b"x" * (huge_line_mb << 20) + b'"}\n')
        for s in range(1, records + 1):
            row = {"step": s, "loss": 3.0 / (1 + s / 1000), "lr": 3e-4, "grad_norm": 1.0, "tokens_per_sec": 12345.6}
            row |= {"tokens_seen": 2048 * s, "time": 1.7e9 + s}
            if s % 500 == 0:
                row["eval_loss"] = 3.1 / (1 + s / 1000)
            f.write(json.dumps(row).encode() + b"\n")


def _task(path: Path, context_chars: int) -> None:
    with path.open("w") as f:
        for i in range(10):
            context = "The quick brown fox jumps over the lazy dog. " * (context_chars // 45 if i == 0 else 2)
            f.write(json.dumps({"context": context, "choices": [" yes", " no"], "answer": i % 2}) + "\n")


def build(work: Path, env: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    """Train, export, craft every input; returns command -> variant -> argv."""
    run = work / "run"
    subprocess.run([*kforge(), "train", "--run-dir", str(run), *ARGS], check=True, env=env, capture_output=True)
    step = run / "checkpoints" / "step_2"
    hf = work / "hf"
    subprocess.run([*kforge(), "export-hf", str(step), str(hf)], check=True, env=env, capture_output=True)
    cases: dict[str, dict[str, list[str]]] = {"generate ckpt": {}, "generate hf": {}, "verify": {}}
    ckpt_claims = {
        "vocab_1e9": {"vocab_size": 10**9},
        "ctx_2^23": {"max_seq_len": 2**23},
        "layers_1e6": {"n_layers": 10**6},
    }
    hf_claims = {
        "vocab_1e9": {"vocab_size": 10**9},
        "ctx_2^23": {"max_position_embeddings": 2**23},
        "layers_1e6": {"num_hidden_layers": 10**6},
    }
    cases["generate ckpt"]["honest"] = [*kforge(), "generate", str(step), *GENERATE]
    for name, claims in ckpt_claims.items():
        copy = Path(shutil.copytree(run, work / f"ckpt_{name}"))
        _claim_in_checkpoint(copy / "checkpoints" / "step_2", claims)
        cases["generate ckpt"][name] = [*kforge(), "generate", str(copy / "checkpoints" / "step_2"), *GENERATE]
    cases["generate hf"]["honest"] = [*kforge(), "generate", str(hf), *GENERATE]
    for name, claims in hf_claims.items():
        copy = Path(shutil.copytree(hf, work / f"hf_{name}"))
        _claim_in_hf(copy, claims)
        cases["generate hf"][name] = [*kforge(), "generate", str(copy), *GENERATE]
    cases["verify"]["honest"] = [*kforge(), "inspect-ckpt", str(step), "--verify"]
    ws = Path(shutil.copytree(run, work / "world"))
    state_path = ws / "checkpoints" / "step_2" / "train_state.json"
    state = json.loads(state_path.read_text())
    state["world_size"] = 300_000
    state_path.write_text(json.dumps(state))
    cases["verify"]["world_size_3e5"] = [*kforge(), "inspect-ckpt", str(ws / "checkpoints" / "step_2"), "--verify"]

    honest_runs, bomb_runs = work / "runs_honest", work / "runs_bomb"
    for root, records, huge in ((honest_runs, 20_000, 0), (bomb_runs, 850_000, 16)):
        d = root / "r1"
        d.mkdir(parents=True)
        shutil.copy(run / "config.toml", d / "config.toml")
        _metrics(d / "metrics.jsonl", records, huge)
    cases["runs"] = {
        "honest": [*kforge(), "runs", str(honest_runs)],
        "metrics_144MB": [*kforge(), "runs", str(bomb_runs)],
    }
    cases["plot"] = {
        "honest": [*kforge(), "plot", str(honest_runs / "r1"), "-o", str(work / "a.png")],
        "metrics_144MB": [*kforge(), "plot", str(bomb_runs / "r1"), "-o", str(work / "b.png")],
    }
    _task(work / "small.jsonl", 0)
    _task(work / "huge.jsonl", 50 << 20)
    cases["eval mc"] = {
        "honest": [*kforge(), "eval", str(step), "--task", str(work / "small.jsonl")],
        "context_50MB": [*kforge(), "eval", str(step), "--task", str(work / "huge.jsonl")],
    }
    # Issue 40: a prompt file, a task YAML alias bomb, crafted HF configs of the newer import classes.
    (work / "prompt.txt").write_text("Once upon a time\n")
    with (work / "prompt_1GiB.txt").open("wb") as f:  # sparse: costs no disk
        f.truncate(1 << 30)
    gen = ["--max-new-tokens", "8", "--temperature", "0"]
    cases["generate file"] = {
        "honest": [*kforge(), "generate", str(step), "--prompt-file", str(work / "prompt.txt"), *gen],
        "prompt_1GiB": [*kforge(), "generate", str(step), "--prompt-file", str(work / "prompt_1GiB.txt"), *gen],
    }
    honest_yaml = HERE.parent / "tests" / "data" / "lm_eval" / "kforge_tiny_mc.yaml"
    bomb = ["task: bomb", 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    bomb += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    (work / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    cases["eval lm-eval"] = {
        "honest": [*kforge(), "eval", str(step), "--task", f"lm-eval:{honest_yaml}", "--limit", "4"],
        "alias_bomb_1.5KB": [*kforge(), "eval", str(step), "--task", f"lm-eval:{work / 'bomb.yaml'}"],
    }
    cases["generate hf moe"] = {"honest": [*kforge(), "generate", str(hf), *GENERATE]}
    ernie = {"model_type": "ernie4_5_moe", "moe_intermediate_size": 32, "moe_num_experts": 4, "moe_k": 2}
    for name, claims in {
        "ernie_interval_0": {**ernie, "moe_layer_interval": 0},
        "ernie_layers_1e12": {**ernie, "num_hidden_layers": 10**12},
    }.items():
        copy = Path(shutil.copytree(hf, work / f"hf_{name}"))
        _claim_in_hf(copy, claims)
        cases["generate hf moe"][name] = [*kforge(), "generate", str(copy), *GENERATE]
    return cases


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", type=Path, default=None, help="PYTHONPATH of the kforge tree to measure")
    parser.add_argument("--timeout", type=float, default=120.0, help="kill a command after this many seconds")
    opts = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if opts.src:
        env["PYTHONPATH"] = str(opts.src.resolve())
    work = Path(tempfile.mkdtemp(prefix="kforge-bombs-"))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for command, variants in build(work, env).items():
            rows[command] = {name: measure(cmd, env, opts.timeout) for name, cmd in variants.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'command':<17}{'input':<20}{'peak MB':>10}{'x honest':>10}{'wall s':>9}{'x honest':>10}{'exit':>9}")
    worst_rss = worst_wall = 0.0
    for command, variants in rows.items():
        base = variants["honest"]
        for name, r in variants.items():
            rss, wall = r["peak_rss_mb"] / base["peak_rss_mb"], r["wall_s"] / base["wall_s"]
            r["rss_ratio"], r["wall_ratio"] = round(rss, 2), round(wall, 2)
            if name != "honest":
                worst_rss, worst_wall = max(worst_rss, rss), max(worst_wall, wall)
            print(
                f"{command:<17}{name:<20}{r['peak_rss_mb']:>10.1f}{rss:>10.2f}{r['wall_s']:>9.2f}{wall:>10.2f}"
                f"{r['exit']!s:>9}"
            )
    print(f"worst bomb/honest: peak RSS {worst_rss:.2f}x, wall time {worst_wall:.2f}x (target <= 2.00)")
    out = HERE / "results" / "hostile_bombs.json"
    out.parent.mkdir(exist_ok=True)
    result = {
        "src": str(opts.src) if opts.src else "this tree",
        "rows": rows,
        "worst_rss_ratio": round(worst_rss, 2),
        "worst_wall_ratio": round(worst_wall, 2),
    }
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
