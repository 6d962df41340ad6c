"""Each parallelism's cost terms beside its code (engine.parallel.*.comm_terms), the optimizer step and
every pipeline rank in the step-time model, and one figure per layout whichever command prints it."""

from __future__ import annotations

import pytest

from kforge_cli.engine.parallel import context_parallel, expert_parallel, fsdp, pipeline, tensor_parallel
from kforge_cli.engine.parallel.cost_terms import Traffic
from kforge_cli.engine.plan.cost_model import StepShape, cost_constants, estimate_step, rank_work
from kforge_cli.engine.plan.costs import newton_schulz_flops, optimizer_step_bytes
from kforge_cli.engine.plan.param_shards import build_template, rank_place
from kforge_cli.engine.plan.search import predict_step
from kforge_cli.settings import load_settings, resolve_dims


def test_fsdp_terms_gather_per_micro_batch_and_reduce_once() -> None:
    terms = fsdp.comm_terms(
        dense_numel=1000,
        expert_numel=0,
        dp_shard=4,
        dp_replicate=2,
        cp=1,
        tp=2,
        ep=1,
        micro_batches=3,
        reshard_after_forward=True,
        compute_bytes=2,
    )
    # all-gathers: 3 micro-batches x forward + backward x 2 bytes, one fp32 reduce-scatter; 3/4 leaves the rank
    assert terms[0] == Traffic("fsdp", (3 * 2 * 2 + 4) * 1000 * 3 / 4, 4, 2)
    # HSDP: an fp32 all-reduce (twice the buffer) of the 1/4 shard over dp_replicate = 2, ranks 4 x 2 apart
    assert terms[1] == Traffic("fsdp", 2 * 1000 / 4 * 4 * 1 / 2, 2, 8)


def test_tp_cp_ep_pp_terms() -> None:
    assert tensor_parallel.comm_terms(tp=1, n_blocks=4, rerun_blocks=0, micro_batches=1, activation_bytes=10) == []
    tp = tensor_parallel.comm_terms(tp=4, n_blocks=4, rerun_blocks=4, micro_batches=2, activation_bytes=10)
    assert tp == [Traffic("tp", (8 * 2 * 4 + 4 * 2 * 4) * 10 * 3 / 4, 4, 1)]
    cp = context_parallel.comm_terms(cp=2, tp=2, n_blocks=3, rerun_blocks=0, micro_batches=1, kv=100)
    assert cp == [Traffic("cp", 2 * 3 * 100 / 2, 2, 2)]
    assert pipeline.comm_terms(pp=4, stride=16, n_stages=2, micro_batches=8, activation_bytes=10) == [
        Traffic("pp", 2 * 8 * 2 * 10, 2, 16)
    ]
    assert pipeline.bubble_share("1f1b", 4, 1, 8) == pytest.approx(3 / 11)
    moe = load_settings(profile="moe-debug", use_env=False).settings.model
    assert moe.moe is not None
    sent = expert_parallel.all_to_all_bytes(moe, 4, 64, False, 2, 2)
    assert sent == 2 * 2 * 64 * moe.moe.top_k * moe.dim * 2 * 3 // 4 * 2
    assert expert_parallel.comm_terms(
        moe, ep=4, stride=2, tokens=64, full_ac=False, n_moe_layers=2, compute_bytes=2
    ) == [Traffic("ep", sent, 4, 2)]
    assert (
        expert_parallel.comm_terms(moe, ep=1, stride=1, tokens=64, full_ac=False, n_moe_layers=2, compute_bytes=2) == []
    )


def test_optimizer_bytes_and_newton_schulz_flops() -> None:
    from kforge_cli.engine.train.optim.muon_distributed import newton_schulz_flops as trained

    assert optimizer_step_bytes("adamw", 4, matrix=True) == 28  # p, g, m, v read; p, m, v written
    assert optimizer_step_bytes("lion", 4, matrix=False) == 20
    assert optimizer_step_bytes("muon", 4, matrix=True) == 20
    assert optimizer_step_bytes("muon", 4, matrix=False) == 28  # AdamW for what Muon does not manage
    for rows, cols in ((64, 256), (300, 70), (5, 5)):
        assert newton_schulz_flops(rows, cols, 5) == trained(rows, cols, 5)


def test_muon_step_costs_more_than_adamw() -> None:
    base = ["--distributed.dp_shard=8", "--slurm.nodes=1"]
    adamw = predict_step(load_settings(profile="h100x8", overrides=base, use_env=False).settings, 8)
    muon = predict_step(
        load_settings(profile="h100x8", overrides=[*base, "--optimizer.name=muon"], use_env=False).settings, 8
    )
    assert 0 < adamw.optimizer_s < muon.optimizer_s
    assert adamw.compute_s == muon.compute_s


def test_every_pipeline_rank_is_timed() -> None:
    """6 layers over pp = 4 (1F1B): stages of 2, 2, 1, 1 blocks; the MoE blocks make pipeline rank 1,
    neither the first nor the last, the slowest, and the step is its estimate."""
    over = ["--model.n_layers=6", "--distributed.pp=4", "--distributed.pp_schedule=1f1b"]
    over += ["--train.grad_accum_steps=8", "--slurm.gpus_per_node=4"]
    s = load_settings(profile="moe-debug", overrides=over, use_env=False).settings
    step = predict_step(s, 4)
    dims, template = resolve_dims(s, 4), build_template(s)
    consts = cost_constants(s, "float32")
    by_rank = [
        estimate_step(s, StepShape.of(s), dims, rank_work(s, dims, template, rank_place(s, r), cuda=False), consts, 4)
        for r in range(4)
    ]
    slowest = max(range(4), key=lambda r: by_rank[r].step_s)
    assert slowest == step.pp_rank == 1
    assert step.step_s == by_rank[1].step_s > max(by_rank[0].step_s, by_rank[3].step_s)


@pytest.mark.parametrize(
    "n_layers,pp,schedule,v",
    [
        (6, 4, "1f1b", 1),
        (7, 3, "gpipe", 1),
        (8, 3, "interleaved_1f1b", 2),
        (10, 2, "interleaved_1f1b", 3),
        (9, 4, "1f1b", 1),
    ],
)
def test_the_step_is_the_slowest_of_all_pipeline_ranks(n_layers: int, pp: int, schedule: str, v: int) -> None:
    """The search skips a rank another dominates; the result is still the maximum over every rank."""
    over = [f"--model.n_layers={n_layers}", f"--distributed.pp={pp}", f"--distributed.pp_schedule={schedule}"]
    over += [f"--distributed.pp_stages_per_rank={v}", "--train.grad_accum_steps=8", f"--slurm.gpus_per_node={pp}"]
    s = load_settings(profile="moe-debug", overrides=over, use_env=False).settings
    dims, template = resolve_dims(s, pp), build_template(s)
    consts = cost_constants(s, "float32")
    every = [
        estimate_step(s, StepShape.of(s), dims, rank_work(s, dims, template, rank_place(s, r), cuda=False), consts, 4)
        for r in range(pp)
    ]
    assert predict_step(s, pp).step_s == max(e.step_s for e in every)
