"""Benchmark: peak RSS of `inspect-ckpt --verify`, `--tensor` and resume on crafted vs honest checkpoints.

A tiny run is trained once (checkpoints at steps 2 and 4); each variant is a copy of it whose
step_4 ``.metadata`` is rewritten the way an attacker would: a storage entry reading 1.5 GB
from a link to /dev/zero, a tensor declaring 150M or 2**40 elements, a storage path naming
another run's shard. Every command runs in its own process; its peak RSS comes from
``os.wait4``. Target (issue 15): each crafted variant within 2x of the honest checkpoint.
Prints a table and writes bench/results/hostile_ckpt_rss.json.

    python bench/hostile_ckpt_rss.py [--src OTHER/src]   # --src: measure another tree (e.g. the old code)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KEY = "model.tok_embeddings.weight"
ARGS = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=64",
    "--train.batch_size=4",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last_n=0",
    "--metrics.progress_bar=off",
    "--train.num_threads=1",
]


def kforge() -> list[str]:
    exe = shutil.which("kforge", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "kforge_cli"]


def peak_rss_mb(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(peak RSS in MB, exit code) of `cmd` run alone in a child process."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024, proc.returncode


def _edit(step: Path, edit: Any) -> None:
    from kforge_cli.engine.checkpoint import read_dcp_metadata

    md = read_dcp_metadata(step)
    edit(md, step)
    (step / ".metadata").write_bytes(pickle.dumps(md))


def _storage(md: Any, fqn: str = KEY, **changes: Any) -> None:
    for index, info in list(md.storage_data.items()):
        if index.fqn == fqn:
            md.storage_data[index] = dataclasses.replace(info, **changes)


def _dev_zero(md: Any, step: Path) -> None:
    """A tensor and a non-tensor item (read whole into memory by DCP) both read 1.5 GB of /dev/zero."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    os.symlink("/dev/zero", step / "zero")
    item = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    for fqn in (KEY, item):
        _storage(md, fqn, relative_path="zero", offset=0, length=1_500_000_000)


def _shape(n: int) -> Any:
    def edit(md: Any, step: Path) -> None:
        import torch

        item = md.state_dict_metadata[KEY]
        item.size = item.chunks[0].sizes = torch.Size([n])
        item.chunks[0].offsets = torch.Size([0])
        old = next(i for i in md.storage_data if i.fqn == KEY)
        md.storage_data[type(old)(KEY, [0])] = md.storage_data.pop(old)

    return edit


def _other_file(other: Path) -> Any:
    def edit(md: Any, step: Path) -> None:
        shard = next(p for p in other.iterdir() if p.suffix == ".distcp")
        _storage(md, relative_path=str(shard))

    return edit


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", type=Path, default=None, help="PYTHONPATH of the kforge tree to measure")
    opts = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if opts.src:
        env["PYTHONPATH"] = str(opts.src.resolve())
    work = Path(tempfile.mkdtemp(prefix="kforge-rss-"))
    try:
        honest = work / "trained"
        subprocess.run(
            [*kforge(), "train", "--run-dir", str(honest), *ARGS, "--train.max_steps=4"], check=True, env=env
        )
        other = work / "other"
        shutil.copytree(honest, other)
        variants = {
            "honest": None,
            "link_to_dev_zero_1.5GB": _dev_zero,
            "size_150M": _shape(150_000_000),
            "size_2**40": _shape(2**40),
            "path_to_other_run": _other_file(other / "checkpoints" / "step_4"),
        }
        rows: dict[str, dict[str, Any]] = {}
        runs: dict[str, Path] = {}
        for name, edit in variants.items():  # every copy made before anything resumes (a resume adds step_5)
            runs[name] = work / name
            shutil.copytree(honest, runs[name])
            if edit is not None:
                _edit(runs[name] / "checkpoints" / "step_4", edit)
        for name, run in runs.items():
            step = str(run / "checkpoints" / "step_4")
            cmds = {
                "verify": [*kforge(), "inspect-ckpt", step, "--verify"],
                "tensor": [*kforge(), "inspect-ckpt", step, "--tensor", KEY],
                "resume": [*kforge(), "train", "--run-dir", str(run), *ARGS, "--train.max_steps=5"],
            }
            rows[name] = {}
            for what, cmd in cmds.items():
                mb, code = peak_rss_mb(cmd, env)
                rows[name][what] = {"peak_rss_mb": round(mb, 1), "exit": code}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows["honest"]
    print(f"{'checkpoint':<26}" + "".join(f"{w + ' MB (exit)':>20}{'x honest':>10}" for w in base))
    for name, row in rows.items():
        cells = "".join(
            f"{r['peak_rss_mb']:>14.1f} ({r['exit']:>3}){r['peak_rss_mb'] / base[w]['peak_rss_mb']:>10.2f}"
            for w, r in row.items()
        )
        print(f"{name:<26}{cells}")
    worst = max(r["peak_rss_mb"] / base[w]["peak_rss_mb"] for row in rows.values() for w, r in row.items())
    print(f"worst crafted/honest ratio: {worst:.2f} (target <= 2.00)")
    out = HERE / "results" / "hostile_ckpt_rss.json"
    out.parent.mkdir(exist_ok=True)
    result = {"src": str(opts.src) if opts.src else "this tree", "rows": rows, "worst_ratio": worst}
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
