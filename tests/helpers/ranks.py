"""The rank side of ``tests.helpers.launch.run_ranks``: one process group, many cases.

Every rank runs ``main(CASES_JSON, OUT_DIR)``: it creates the process group once and runs
each case ``{"name", "fn": "module:function", "args"}`` in order, as
``function(name, args, out_dir)``, writing what it returns to
``OUT_DIR/<name>.rank<r>.json``. A case that raises is recorded as
``{"status": "error", "error": traceback}`` and ends the launch (the other ranks may be
waiting in one of its collectives). Also runnable under torchrun: ``-m tests.helpers.ranks``.

``train`` is the usual case: ``run_training`` of some overrides (each case builds a fresh
mesh and leaves the group it did not create alive), recording what every rank saw.
"""

from __future__ import annotations

import importlib
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


def train(name: str, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """``run_training`` of ``overrides`` in ``OUT_DIR/<name>``; what this rank saw (also usable in-process)."""
    settings = load_settings(overrides=[*overrides, f"--train.run_dir={Path(out_dir) / name}"]).settings
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


def train_cases(cases: dict[str, list[str]], base: list[str] | None = None) -> list[dict[str, Any]]:
    """``train`` cases: {name: overrides} -> the launch's case list (``base`` first in each)."""
    return [{"name": n, "fn": f"{__name__}:train", "args": [*(base or []), *o]} for n, o in cases.items()]


def main(cases_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(cases_file).read_text())
    out = Path(out_dir)
    if torch.cuda.is_available():  # the gpu-marked cases: NCCL for CUDA tensors, gloo for the rest
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    failed = False
    for case in cases:
        module, function = case["fn"].split(":")
        try:
            result = getattr(importlib.import_module(module), function)(case["name"], case["args"], out)
        except Exception:  # record and stop: the other ranks may be stuck in a collective of this case
            result = {"status": "error", "error": traceback.format_exc()}
            failed = True
        (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
        if failed:
            break
        dist.barrier()
    if not failed:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called without an
    # active exception") after a clean destroy_process_group; the results are on disk.
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
