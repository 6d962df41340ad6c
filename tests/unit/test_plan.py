"""`build_plan` on big shipped layouts (meta device, fake process group) and small exact cases.

Known values: an 8B Llama-3 shape sharded 64 ways (every dim divides 64) holds exactly
total/64 parameters per rank; the 70B profile (tp=8 with sequence parallelism, dp_shard=8)
holds (total - norms)/64 + norms/8, since the norm weights are replicated over TP.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from kforge_cli.engine.plan.planner import GIB, ParallelPlan, build_plan
from kforge_cli.engine.plan.report import format_plan, plan_json
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, load_settings

H100_BF16 = 989.4e12


def _settings(profile: str | None = None, *overrides: str) -> JobSettings:
    return load_settings(profile=profile, overrides=list(overrides)).settings


@pytest.fixture(scope="module")
def llama8b_fsdp64() -> tuple[JobSettings, ParallelPlan, ParallelPlan]:
    s = _settings("h100x64", "--distributed.tp=1")
    return s, build_plan(s, 64, 0), build_plan(s, 64, 63)


@pytest.fixture(scope="module")
def llama70b() -> tuple[JobSettings, ParallelPlan]:
    s = _settings("llama70b-h100x64")
    return s, build_plan(s, 64, 5)


def test_8b_fsdp64_parameters_are_total_over_64(llama8b_fsdp64: tuple) -> None:
    s, first, last = llama8b_fsdp64
    total = s.model.param_count()
    assert total == 8_030_261_248 and total % 64 == 0
    for plan in (first, last):
        assert plan.total_params == total
        assert plan.local_params == total // 64
        assert plan.item("parameters").bytes == 4 * total // 64  # fp32 master weights
        assert plan.item("gradients").bytes == 4 * total // 64
        n_tensors = 32 * 9 + 3  # 9 per block (7 linears, 2 norms) + embedding, final norm, head
        assert plan.item("optimizer state").bytes == 2 * 4 * total // 64 + 4 * n_tensors  # AdamW moments + step
    assert first.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "tp": 1}
    assert last.coordinates["dp_shard"] == 63


def test_70b_tp8_dp8_parameters(llama70b: tuple) -> None:
    s, plan = llama70b
    total = s.model.param_count()
    norms = (2 * 80 + 1) * 8192
    assert total == 70_553_706_496
    assert plan.local_params == (total - norms) // 64 + norms // 8 == 1_102_545_920
    assert plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 8}
    assert plan.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 5}
    assert [s.layers for s in plan.stages] == [list(range(80))]
    assert plan.fits and plan.peak_bytes < 80 * GIB
    assert plan.build_seconds < 60  # sanity only: the bench measures speed


def test_70b_step_is_the_cost_models_with_its_parts(llama70b: tuple) -> None:
    """The plan's step time is the search's cost model (one figure per layout): compute at 40% MFU
    (without recompute it is the FLOPs count's), plus full AC's recompute, exposed TP and FSDP
    communication and the optimizer step; the parts add up to the step."""
    from kforge_cli.engine.plan.search import predict_step

    s, plan = llama70b
    t, e = plan.throughput, plan.step
    assert e is not None and plan.constants is not None and plan.constants.mfu == 0.4
    assert t.tokens_per_step == 1 * 8192 * 8 * 8  # batch x seq x accumulation x dp
    assert t.flops_per_step == pytest.approx(t.flops_per_token * t.tokens_per_step)
    assert e.compute_s - e.recompute_s == pytest.approx(t.flops_per_step / (64 * H100_BF16 * 0.4), rel=1e-3)
    base = e.compute_s - e.recompute_s
    assert 0.3 * base < e.recompute_s < base / 3  # AC full: a third of the blocks' FLOPs again (not the head's)
    assert set(e.exposed) == {"fsdp", "tp"} and e.bubble_s == 0 and e.optimizer_s > 0
    assert sum(e.parts().values()) == pytest.approx(e.step_s)
    assert t.step_time_s == e.step_s == predict_step(s, 64).step_s
    assert t.tokens_per_s == pytest.approx(t.tokens_per_step / e.step_s)
    assert "= compute 13.245 s (recompute 3.279) + exposed comm fsdp 0.695, tp 2.505" in format_plan(plan)


def test_70b_on_8_gpus_does_not_fit() -> None:
    s = _settings("llama70b-h100x64", "--slurm.nodes=1", "--distributed.dp_shard=1")
    plan = build_plan(s, 8, 0)
    assert not plan.fits and plan.peak_bytes > plan.capacity_bytes == 80 * GIB
    assert plan.biggest.name == "optimizer state"
    assert plan.item("parameters").bytes > 30 * GIB  # 70B x 4 bytes / 8, no data-parallel sharding
    text = format_plan(plan)
    assert "DOES NOT FIT (biggest item: optimizer state" in text


def test_pipeline_rank_builds_only_its_stage() -> None:
    s = _settings(None, "--distributed.pp=2", "--train.grad_accum_steps=2")  # cpu-debug: 4 blocks, dim 128
    plan = build_plan(s, 4, 3)  # pp=2 x dp_shard=2: rank 3 is pp rank 1, dp_shard 1
    assert plan.coordinates == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "tp": 0}
    assert [(st.pp_rank, st.layers, st.embedding, st.head) for st in plan.stages] == [
        (0, [0, 1], True, False),
        (1, [2, 3], False, True),
    ]
    assert plan.rank_stages == [1]
    m = s.model
    block = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128
    stage = 2 * block + 128 + m.vocab_size * 128  # blocks 2, 3 + final norm + head
    assert plan.local_params == stage // 2
    assert plan.activations.microbatches_in_flight == 1  # the last pipeline rank
    assert build_plan(s, 4, 0).activations.microbatches_in_flight == 2


@pytest.mark.parametrize("name", ["adamw", "lion", "muon"])
@pytest.mark.parametrize("tied", [False, True])
def test_optimizer_state_equals_the_real_optimizer(name: str, tied: bool) -> None:
    from kforge_cli.engine.parallel import build_parallel_model
    from kforge_cli.engine.runtime import init_runtime
    from kforge_cli.engine.train.optim.optimizer import build_optimizer

    s = _settings(
        None,
        "--model.dim=64",
        "--model.n_layers=2",
        f"--optimizer.name={name}",
        f"--model.tie_embeddings={str(tied).lower()}",
    )
    model, _ = build_parallel_model(s, init_runtime(s))
    optimizer = build_optimizer(model, s.optimizer)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    real = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values())
    assert build_plan(s, 1, 0).item("optimizer state").bytes == real


def test_warnings_bubble_tp_across_nodes_tiny_batch() -> None:
    bubble = build_plan(_settings(None, "--distributed.pp=4", "--train.grad_accum_steps=4"), 4, 0)
    assert any(w.startswith("pipeline bubble: 43%") for w in bubble.warnings), bubble.warnings
    across = _settings(None, "--slurm.nodes=2", "--slurm.gpus_per_node=6", "--distributed.tp=4", "--model.n_kv_heads=4")
    assert any("crosses nodes" in w for w in build_plan(across, 12, 0).warnings)
    tiny = build_plan(_settings(None, "--train.device=cuda"), 1, 0)  # 16 x 128 tokens per micro-batch
    assert any(w.startswith("tiny per-GPU batch: 2048 tokens") for w in tiny.warnings)
    assert not any("crosses" in w or "bubble" in w for w in tiny.warnings)


def test_json_and_table(llama70b: tuple) -> None:
    _, plan = llama70b
    data = json.loads(plan_json(plan))
    assert data["verdict"] == "FITS" and data["fits"] is True
    assert data["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 8}
    names = [m["name"] for m in data["memory"]]
    assert names[:4] == ["parameters", "gradients", "optimizer state", "activations"]
    assert data["memory"][0]["bytes"] == plan.item("parameters").bytes
    text = format_plan(plan)
    assert "pp=1 x dp_replicate=1 x dp_shard=8 x tp=8" in text
    assert "80 blocks (0-79) + embedding, norm + head" in text
    assert "FITS (biggest item: optimizer state" in text


def test_bad_rank_and_no_leftover_process_group() -> None:
    s = _settings()
    with pytest.raises(InvalidInputError, match="--rank must be in"):
        build_plan(s, 4, 4)
    with pytest.raises(InvalidInputError, match="--mfu"):
        build_plan(s, 4, 0, mfu=0.0)
    build_plan(s, 4, 2)
    assert not dist.is_initialized()  # the fake process group is destroyed after the build


def test_the_plans_muon_round_is_the_optimizers() -> None:
    from kforge_cli.engine.plan.costs import MUON_ROUND_BYTES
    from kforge_cli.engine.train.optim.muon_distributed import ROUND_BYTES

    assert MUON_ROUND_BYTES == ROUND_BYTES


def test_split_muon_plans_an_owners_round_and_the_gathered_path_each_matrix_whole() -> None:
    from kforge_cli.engine.plan.costs import MUON_ROUND_BYTES, optimizer_step_temporaries
    from kforge_cli.engine.plan.sharded_model import ParamShard

    big = 8192 * 28672  # an 8B-class MLP matrix, fp32, over 8 ranks
    params = [ParamShard(f"w{i}", big // 8, big, big, 4, 2, True, False) for i in range(4)]
    largest, local = 4 * big, 4 * big // 8

    def temporaries(*flags: str) -> int:
        return optimizer_step_temporaries(params, _settings(None, "--optimizer.name=muon", *flags), True)

    assert temporaries("--optimizer.muon_distributed=false") == 4 * largest + local
    assert temporaries() == 2 * max(MUON_ROUND_BYTES, largest) + 3 * largest + local
    small = [ParamShard("w", 64, 128, 128, 4, 2, True, False)]  # a tiny model: its share, not 64 MiB
    s = _settings(None, "--optimizer.name=muon")
    assert optimizer_step_temporaries(small, s, True) == 2 * (512 // 2 + 512) + 3 * 512 + 256
