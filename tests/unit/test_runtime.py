"""Runtime and parallel plan without processes: launcher detection, backend, mesh shape,
pipeline splits, the sharded-init replay, gradient-norm math, combination rules."""

from __future__ import annotations

import math

import pytest
import torch

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.parallel.grad_norm import clip_grad_norm
from kforge_cli.engine.parallel.init import init_sharded
from kforge_cli.engine.parallel.pipeline import (
    build_stage_module,
    stage_ids_of_rank,
    stage_layer_ids,
    stage_owner,
)
from kforge_cli.engine.runtime import detect_launch, mesh_shape, resolve_backend
from kforge_cli.engine.runtime.launcher import first_host, port_from_job_id
from kforge_cli.engine.runtime.local_launch import exit_code_of
from kforge_cli.errors import ConfigError, InvalidInputError
from kforge_cli.settings import ParallelDims, load_settings, resolve_dims

# --- launcher detection -----------------------------------------------------------


def test_single_process_when_no_launcher_variables() -> None:
    info = detect_launch({})
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("single", 0, 0, 1)


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node3", "MASTER_PORT": "29600"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("torchrun", 5, 1, 8)
    assert (info.master_addr, info.master_port) == ("node3", 29600)


def test_srun_variables_give_rank_world_and_rendezvous() -> None:
    env = {
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "16",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[007-010,020],cpu1",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("srun", 9, 1, 16)
    assert info.master_addr == "gpu007"
    assert info.master_port == 15000 + 123456 % 10000 == port_from_job_id("123456")


def test_torchrun_under_srun_is_torchrun() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}
    assert detect_launch(env).launcher == "torchrun"


def test_sbatch_script_itself_is_not_a_rank() -> None:
    # The batch step has SLURM_PROCID but no SLURM_STEP_ID: it launches ranks, it is not one.
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).launcher == "single"


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node1", "node1"), ("a[3-5]", "a3"), ("gpu[012,020-023]", "gpu012"), ("x-1[09]", "x-109"), ("h1,h2", "h1")],
)
def test_first_host_of_a_nodelist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


# --- backend and mesh ---------------------------------------------------------------


def test_backend_drops_nccl_on_a_cpu_build_and_keeps_gloo() -> None:
    usable = torch.distributed.is_nccl_available() and torch.cuda.is_available()
    want = "cpu:gloo,cuda:nccl" if usable else "cpu:gloo"
    assert resolve_backend("cpu:gloo,cuda:nccl", torch.device("cpu")) == want
    assert resolve_backend("gloo", torch.device("cpu")) == "gloo"


def test_backend_drops_nccl_with_a_cuda_build_on_a_machine_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA wheel (pip's default on Linux) on a CPU machine: NCCL is in the build but refuses to
    start without a GPU ("ProcessGroupNCCL is only supported with GPUs"), so a CPU run keeps gloo only."""
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("cpu:gloo,cuda:nccl", torch.device("cpu")) == "cpu:gloo"
    with pytest.raises(InvalidInputError, match="nccl"):
        resolve_backend("cpu:gloo,cuda:nccl", torch.device("cuda"))


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch build has NCCL")
def test_backend_for_cuda_without_nccl_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="nccl"):
        resolve_backend("cpu:gloo,cuda:nccl", torch.device("cuda"))


def test_mesh_has_dp_shard_always_and_other_dims_only_when_used() -> None:
    assert mesh_shape(ParallelDims(pp=1, dp_replicate=1, dp_shard=8, tp=1)) == [("dp_shard", 8)]
    assert mesh_shape(ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=2)) == [("dp_shard", 1), ("tp", 2)]
    assert mesh_shape(ParallelDims(pp=2, dp_replicate=2, dp_shard=4, tp=8)) == [
        ("pp", 2),
        ("dp_replicate", 2),
        ("dp_shard", 4),
        ("tp", 8),
    ]


# --- pipeline layout ----------------------------------------------------------------


def test_stage_split_gives_extra_blocks_to_early_stages() -> None:
    assert stage_layer_ids(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert stage_layer_ids(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        stage_layer_ids(3, 4)


def test_looped_and_v_stage_placement() -> None:
    assert stage_ids_of_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert [stage_owner(s, 4, "interleaved_1f1b") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_ids_of_rank(0, 4, 2, "zbv_zero_bubble") == [0, 7]  # rank 0: first and last stage
    assert [stage_owner(s, 4, "dualpipev") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    for rank in range(4):
        assert all(
            stage_owner(s, 4, "zbv_zero_bubble") == rank for s in stage_ids_of_rank(rank, 4, 2, "zbv_zero_bubble")
        )


def test_stage_module_keeps_full_model_names() -> None:
    cfg = load_settings(overrides=["--model.n_layers=4"]).settings.model
    mid = build_stage_module(cfg, [2], first=False, last=False)
    assert {n.split(".")[1] for n, _ in mid.named_parameters()} == {"2"}
    last = build_stage_module(cfg, [3], first=False, last=True)
    assert {n for n, _ in last.named_parameters() if not n.startswith("layers.")} == {"norm.weight", "output.weight"}


# --- sharded init replays the single-process RNG stream ------------------------------


def test_init_of_pipeline_stages_equals_the_single_process_model() -> None:
    """Stages initialised apart hold exactly the weights of one model built with the same seed,
    and the RNG ends where the single-process init leaves it."""
    cfg = load_settings(overrides=["--model.n_layers=3", "--model.dim=32", "--model.n_heads=4"]).settings.model
    torch.manual_seed(7)
    ref = Transformer(cfg)
    after_ref = torch.rand(1)
    layers = stage_layer_ids(3, 2)
    stages = [build_stage_module(cfg, layers[i], first=i == 0, last=i == 1) for i in (1, 0)]  # any order
    torch.manual_seed(7)
    init_sharded(stages, cfg, torch.device("cpu"))
    assert torch.equal(torch.rand(1), after_ref)
    got = {n: p for s in stages for n, p in s.named_parameters()}
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, param in want.items():
        assert torch.equal(got[name], param), name
    assert torch.equal(stages[0].rope_cos, ref.rope_cos)


# --- gradient norm ------------------------------------------------------------------


def test_clip_grad_norm_matches_torch_in_one_process() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    want = float(torch.nn.utils.clip_grad_norm_(twins, max_norm=1.0))
    got = float(clip_grad_norm(params, 1.0))
    assert got == pytest.approx(want, rel=1e-6)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert float(clip_grad_norm(params, math.inf)) == pytest.approx(1.0, rel=1e-5)  # measured after clipping, unchanged


# --- combination rules ----------------------------------------------------------------


def _issues(*overrides: str, world: int) -> list[str]:
    s = load_settings(overrides=list(overrides)).settings
    with pytest.raises(ConfigError) as err:
        resolve_dims(s, world)
    return [i.path for i in err.value.issues]


def test_rules_refuse_combinations_that_would_train_wrong() -> None:
    pp = ["--distributed.pp=2", "--train.grad_accum_steps=2"]
    assert _issues(*pp, "--model.tie_embeddings=true", world=2) == ["model.tie_embeddings"]
    assert _issues("--distributed.tp=2", "--model.tie_embeddings=true", world=2) == ["model.tie_embeddings"]
    zb = [*pp, "--distributed.pp_schedule=zbv_zero_bubble", "--distributed.pp_stages_per_rank=2"]
    assert _issues(*zb, "--distributed.reshard_after_forward=true", world=2) == ["distributed.reshard_after_forward"]
    assert _issues(*zb, "--train.activation_checkpointing=full", world=2) == ["train.activation_checkpointing"]
    dual = [*pp, "--distributed.pp_schedule=dualpipev", "--distributed.pp_stages_per_rank=2"]
    assert _issues(*dual, world=2) == ["train.grad_accum_steps"]  # 2 micro-batches < 4 stages
    cpu_tp = ["--distributed.tp=2", "--train.device=cpu"]
    assert _issues(*cpu_tp, "--train.float8=true", world=2) == ["train.float8"]
    assert _issues(*cpu_tp, "--train.loss_chunk_size=64", "--distributed.loss_parallel=false", world=2) == [
        "train.loss_chunk_size"
    ]


def test_rules_accept_the_supported_combinations() -> None:
    for extra in (
        [
            "--distributed.pp=2",
            "--train.grad_accum_steps=4",
            "--distributed.pp_schedule=dualpipev",
            "--distributed.pp_stages_per_rank=2",
        ],
        ["--distributed.tp=2", "--train.loss_chunk_size=64"],  # vocab-parallel loss instead of chunks
        ["--distributed.dp_replicate=2", "--train.compile_model=true"],
        ["--distributed.tp=2", "--train.device=cpu", "--train.compile_model=true"],  # compile + TP on gloo works
        ["--distributed.tp=2", "--train.device=cpu", "--train.float8=true", "--train.float8_recipe=rowwise"],
    ):
        s = load_settings(overrides=extra).settings
        assert resolve_dims(s, 4).world_size == 4


def test_local_launcher_exit_code_is_the_ranks_code() -> None:
    assert exit_code_of([0, 0]) == 0
    assert exit_code_of([75, 75]) == 75
    assert exit_code_of([0, 2]) == 2
    assert exit_code_of([-9, 0]) == 128 + 9


def test_thread_choice_prefers_settings_then_env_then_a_fair_share_of_free_cores() -> None:
    from kforge_cli.engine.runtime.threads import choose_threads

    assert choose_threads(3, {"OMP_NUM_THREADS": "5"}).threads == 3
    env_choice = choose_threads(None, {"OMP_NUM_THREADS": "5"})
    assert (env_choice.threads, env_choice.source) == (5, "OMP_NUM_THREADS")
    # Another job keeps one of two cores busy: one thread, not two fighting over one core.
    assert choose_threads(None, {}, allowed=2, busy=1).threads == 1
    assert choose_threads(None, {}, allowed=16, busy=0).threads == 16
    shared = choose_threads(None, {"LOCAL_WORLD_SIZE": "4"}, allowed=16, busy=2)
    assert shared.describe() == (
        "3 CPU threads per process (automatic: 16 cores available, 2 busy with other work, 4 local processes; "
        "set train.num_threads or OMP_NUM_THREADS to choose)"
    )
    assert (
        choose_threads(None, {}, allowed=1, busy=0).describe().startswith("1 CPU thread per process (automatic: 1 core")
    )
    assert choose_threads(None, {}, allowed=2, busy=5).threads == 1  # never zero


def test_explain_num_threads_states_the_automatic_rule_not_torchs_default() -> None:
    from kforge_cli.settings import load_settings
    from kforge_cli.settings.explain import explain_key

    text = explain_key(load_settings(), "train.num_threads")
    assert "torch's default" not in text
    for rule in ("OMP_NUM_THREADS", "automatic", "affinity, cgroup quota", "busy", "divided by the local processes"):
        assert rule in text, rule
