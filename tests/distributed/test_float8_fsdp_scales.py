"""FSDP2 float8 all-gather: the weights' scales are precomputed after every optimizer step.

One process with a 1-rank gloo group is enough to hold real FSDP2-sharded float8 weights
(torchao's ``WeightWithDynamicFloat8CastTensor``); the all-gather itself needs NCCL (gpu tests).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from kforge_cli.engine.parallel.float8 import apply_float8, precompute_scales_after_each_step

pytestmark = pytest.mark.distributed
pytest.importorskip("torchao")


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_scales_are_precomputed_after_each_optimizer_step(one_rank_group: None) -> None:
    del one_rank_group
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
    assert apply_float8(model, recipe="tensorwise", fsdp_float8_all_gather=True, skip=()) == 2
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    precompute_scales_after_each_step(optimizer, model)
    weights = [layer.weight for layer in model]
    assert all(getattr(w._local_tensor, "_precomputed_scale", None) is None for w in weights)
    for step in range(2):
        for w in weights:
            w.grad = DTensor.from_local(torch.full_like(w.to_local(), float(step + 1)), mesh, w.placements)
        optimizer.step()
        for w in weights:  # torchao's tensorwise scale: float8 max / amax, of the weights *after* the step
            want = torch.finfo(torch.float8_e4m3fn).max / w.to_local().abs().max().double()
            got = w._local_tensor._precomputed_scale
            assert got is not None, f"step {step}: no precomputed scale"
            torch.testing.assert_close(got, want.float())
