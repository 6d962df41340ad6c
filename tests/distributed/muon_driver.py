"""Distributed-Muon cases of ONE 4-process launch (tests.helpers.launch.run_ranks: gloo, one thread
per process). Two kinds of case (see tests/distributed/test_muon_distributed.py):

- ``optimizer``: a tiny Transformer parallelised by kforge's own TP and FSDP2 functions on a
  kforge mesh, and an unsharded copy on every rank. Both get the same seeded gradients for
  20 steps (the sharded model its blocks of them) and step a Muon built by
  ``build_optimizer``; after every step each rank compares the gathered parameters with the
  unsharded copy's, and with a third copy stepped with ``muon_distributed=false`` (every rank
  gathers and orthogonalises every matrix). A mesh with a ``pp`` dim of 2 runs two
  independent 2-rank jobs at once, one per half of the world, as pipeline stages do.
- ``train``: ``run_training`` with ``optimizer.name=muon`` (tests.helpers.ranks's ``train``);
  the test compares its losses with a single-process run.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.parallel.fsdp import apply_fsdp
from kforge_cli.engine.parallel.tensor_parallel import apply_tensor_parallel
from kforge_cli.engine.runtime.mesh import build_mesh, dp_mesh, sub_mesh
from kforge_cli.engine.train.optim import build_optimizer
from kforge_cli.engine.train.optim.muon import Muon
from kforge_cli.settings import load_settings
from kforge_cli.settings.rules import ParallelDims

MODEL = [  # 4 blocks of 7 matrices: 64x64 (wq, wo), 32x64 (wk, wv), 192x64 / 64x192 (w1, w3 / w2)
    "--model.dim=64",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=320",
    "--model.max_seq_len=64",
    "--train.seq_len=32",
]
STEPS = 20


class Uneven(nn.Module):
    """Matrices whose rows do not split evenly over 4 ranks (FSDP2 leaves some shards empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5, bias=False)
        self.b = nn.Linear(10, 3, bias=False)
        self.c = nn.Linear(3, 10, bias=False)
        self.d = nn.Linear(4, 1, bias=False)


def _reference(spec: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The unsharded model (seed 0) and the settings of the case."""
    settings = load_settings(overrides=[*MODEL, "--optimizer.name=muon", *spec["overrides"]]).settings
    torch.manual_seed(0)
    if spec.get("model") == "uneven":
        return Uneven(), settings
    model = Transformer(settings.model)
    model.init_weights()
    return model, settings


def _parallelise(model: nn.Module, dims: ParallelDims, uneven: bool) -> None:
    mesh = build_mesh(torch.device("cpu"), dims)
    if uneven:
        fully_shard(model, mesh=dp_mesh(mesh))
        return
    tp = sub_mesh(mesh, "tp")
    if tp is not None:
        apply_tensor_parallel(model, tp, sequence_parallel=True, loss_parallel_on=True)
    apply_fsdp(model, dp_mesh(mesh), param_dtype=torch.float32, reshard_after_forward=True)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def run_optimizer_case(spec: dict[str, Any]) -> dict[str, Any]:
    uneven = spec.get("model") == "uneven"
    dims = ParallelDims(**spec["dims"])
    ref, settings = _reference(spec)
    split, gathered = copy.deepcopy(ref), copy.deepcopy(ref)
    _parallelise(split, dims, uneven)
    _parallelise(gathered, dims, uneven)
    no_split = settings.model_copy(
        update={"optimizer": settings.optimizer.model_copy(update={"muon_distributed": False})}
    )
    opt_ref, opt_split = build_optimizer(ref, settings), build_optimizer(split, settings)
    opt_gathered = build_optimizer(gathered, no_split)
    if "round_bytes" in spec:
        assert isinstance(opt_split, Muon)
        opt_split.round_bytes = spec["round_bytes"]
    names = [n for n, _ in ref.named_parameters()]
    max_diff, max_diff_gathered, flops, ref_flops, moved = 0.0, 0.0, [], [], 0.0
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + step)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ref.named_parameters()}
        for model in (ref, split, gathered):
            for n, p in model.named_parameters():
                g = grads[n]
                p.grad = (
                    distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor)
                    else g.clone()
                )
        for opt in (opt_ref, opt_split, opt_gathered):
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert isinstance(opt_split, Muon) and isinstance(opt_ref, Muon)
        flops.append(opt_split.ns_flops_last_step)
        ref_flops.append(opt_ref.ns_flops_last_step)
        want = dict(ref.named_parameters())
        other = dict(gathered.named_parameters())
        for n, p in split.named_parameters():
            got = _full(p)
            max_diff = max(max_diff, (got - want[n].detach()).abs().max().item())
            max_diff_gathered = max(max_diff_gathered, (got - _full(other[n])).abs().max().item())
    for n, p in ref.named_parameters():
        moved = max(moved, (p.detach() - start[n]).abs().max().item())
    return {
        "status": "completed",
        "max_diff": max_diff,
        "max_diff_vs_gathered": max_diff_gathered,
        "moved": moved,  # the largest change of any weight over the run: the comparison is not vacuous
        "ns_flops": flops,
        "ns_flops_one_process": ref_flops,
        "params": names,
    }


def optimizer_case(name: str, spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """A case of the shared rank launcher (tests.helpers.ranks): the optimizer comparison of ``spec``."""
    return run_optimizer_case({"name": name, "overrides": [], **spec})
