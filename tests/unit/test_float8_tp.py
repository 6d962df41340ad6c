"""float8 under tensor parallelism, without a GPU: which TP styles each recipe gets, which
linears are eligible by their per-rank shard shape, and when FSDP all-gathers in float8."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.parallel.float8 import float8_filter, fsdp_float8_all_gather, linear_splits
from kforge_cli.engine.parallel.tensor_parallel import block_plan
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.runtime.launcher import LaunchInfo
from kforge_cli.settings import ParallelDims, load_settings
from kforge_cli.settings.training import TrainSettings


def _block(**model: int) -> nn.Module:
    overrides = [f"--model.{k}={v}" for k, v in {"dim": 64, "n_layers": 1, "n_heads": 4, **model}.items()]
    with torch.device("meta"):
        return Transformer(load_settings(overrides=overrides).settings.model)


@pytest.mark.parametrize("recipe", [None, "rowwise"])
def test_rowwise_float8_and_no_float8_use_the_plain_tp_styles(recipe: str | None) -> None:
    """torchao's float8 TP styles cast activations tensorwise, which a rowwise Float8Linear cannot take."""
    plan = block_plan(_block().layers["0"], sequence_parallel=True, float8_recipe=recipe)
    assert type(plan["attention.wq"]) is ColwiseParallel
    assert type(plan["attention.wo"]) is RowwiseParallel
    assert type(plan["feed_forward"]) is PrepareModuleInput


def test_tensorwise_float8_uses_torchaos_float8_tp_styles() -> None:
    f8tp = pytest.importorskip("torchao.float8.float8_tensor_parallel")
    plan = block_plan(_block().layers["0"], sequence_parallel=True, float8_recipe="tensorwise")
    assert type(plan["attention.wq"]) is f8tp.Float8ColwiseParallel
    assert type(plan["feed_forward.w2"]) is f8tp.Float8RowwiseParallel


def test_float8_eligibility_reads_the_per_rank_shard_shape() -> None:
    """dim 64, MLP 96: w1/w3 (column-parallel, 96 -> 48 per rank) and w2 (row-parallel) stay
    eligible at tp=2; at tp=4 their 24-wide shards and the 16-wide q/o shards are not."""
    model = _block(ffn_hidden_dim=96, n_kv_heads=4)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    def eligible(tp: int) -> set[str]:
        keep = float8_filter(tp, linear_splits(model))
        return {n.split(".")[-1] for n, m in linears.items() if keep(m, n)}

    assert eligible(1) == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}  # the head never
    assert eligible(2) == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert eligible(4) == {"wq", "wk", "wv", "wo"}  # 64/4 = 16 still divides; 96/4 = 24 does not
    assert eligible(8) == set()  # 8-wide shards


def _runtime(device: str, *, dp_shard: int, tp: int = 1) -> RuntimeContext:
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=dp_shard, tp=tp)
    launch = LaunchInfo("torchrun", 0, 0, dims.world_size, "localhost", 29500)
    return RuntimeContext(launch=launch, device=torch.device(device), dims=dims)


def test_fsdp_float8_all_gather_only_for_tensorwise_sharded_cuda_runs() -> None:
    def train(*extra: str) -> TrainSettings:
        return load_settings(overrides=["--train.float8=true", *extra]).settings.train

    assert fsdp_float8_all_gather(train(), _runtime("cuda", dp_shard=2))
    assert not fsdp_float8_all_gather(train("--train.float8_recipe=rowwise"), _runtime("cuda", dp_shard=2))
    assert not fsdp_float8_all_gather(train(), _runtime("cpu", dp_shard=2))  # gloo: no float8 all-gather
    assert not fsdp_float8_all_gather(train(), _runtime("cuda", dp_shard=1, tp=2))  # nothing FSDP-sharded
    assert not fsdp_float8_all_gather(train("--train.float8=false"), _runtime("cuda", dp_shard=2))
