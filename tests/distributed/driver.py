"""Runs several training configurations inside ONE multi-process launch (torchrun).

Usage: ``python -m torch.distributed.run --nproc_per_node=N tests/distributed/driver.py CASES.json OUT_DIR``.
The process group is created here once and reused by every case (``run_training``
builds a fresh mesh per case and leaves a group it did not create alive), which saves
the 5-10 s start-up of a launch per configuration. Each rank writes
``OUT_DIR/<case>.rank<r>.json`` with what it saw: per-step losses and gradient norms,
the bytes of parameters it holds, and the parameter count of the whole model.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kforge_cli.engine.train import TrainHook, run_training
from kforge_cli.settings import load_settings


class Recorder(TrainHook):
    """Collects what every rank sees of the run."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.local_param_bytes = 0
        self.local_param_numel = 0
        self.full_param_numel = 0
        self.pipeline: dict[str, Any] | None = None
        self.expert_bias: list[list[float]] = []  # MoE selection biases after the last step
        self.expert_bias_by_layer: dict[str, list[float]] = {}  # the same by name (a pipeline rank: its stages')
        self.moe_metrics: dict[str, float] = {}  # the last step's moe/... metrics as this rank would log them

    def on_train_begin(self, session: Any) -> None:
        for p in session.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            self.local_param_bytes += local.numel() * local.element_size()
            self.local_param_numel += local.numel()
            self.full_param_numel += p.numel()  # global shape for a DTensor
        if session.pipeline is not None:
            self.pipeline = {"stage_ids": session.pipeline.stage_ids, "is_last": session.pipeline.is_last}

    def on_step_end(self, session: Any, info: Any) -> None:
        self.losses.append(info.loss)
        self.grad_norms.append(info.grad_norm)
        self.expert_bias_by_layer = {
            n: b.tolist() for n, b in session.model.named_buffers() if n.endswith("expert_bias")
        }
        self.expert_bias = list(self.expert_bias_by_layer.values())
        self.moe_metrics = {k: v for k, v in info.extra.items() if k.startswith("moe/")}


def run_case(name: str, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    settings = load_settings(overrides=[*overrides, f"--train.run_dir={out_dir / name}"]).settings
    rec = Recorder()
    outcome = run_training(settings, hooks=[rec])
    return {
        "status": outcome.status,
        "losses": rec.losses,
        "grad_norms": rec.grad_norms,
        "local_param_bytes": rec.local_param_bytes,
        "local_param_numel": rec.local_param_numel,
        "full_param_numel": rec.full_param_numel,
        "pipeline": rec.pipeline,
        "eval_loss": outcome.last_eval_loss,
        "expert_bias": rec.expert_bias,
        "expert_bias_by_layer": rec.expert_bias_by_layer,
        "moe_metrics": rec.moe_metrics,
    }


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    if torch.cuda.is_available():  # the gpu-marked cases: NCCL for CUDA tensors, gloo for the rest
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    failed = False
    for case in cases:
        try:
            result = run_case(case["name"], case["overrides"], out_dir)
        except Exception:  # record and go on: one broken case must not hide the others' results
            result = {"status": "error", "error": traceback.format_exc()}
            failed = True
        (out_dir / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
        if failed:
            break  # the other ranks may be stuck in a collective of the failed case
        dist.barrier()
    dist.barrier() if not failed else None
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called without an
    # active exception") after a clean destroy_process_group; the results are on disk.
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
