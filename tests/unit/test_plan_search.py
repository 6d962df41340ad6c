"""`kforge plan search`: the analytic shards, the search's validity and memory, the cost model.

The search never builds a model per layout: its parameter shards come from a one-block
template (plan.param_shards), checked here against the meta build parameter by parameter on
every rank; every layout it returns must pass the same rules as validate-config at that
world size and have exactly the memory plan's peak (build_plan on its worst pipeline
rank), within the limit; a faster layout the memory plan rejects must not be returned.
"""

from __future__ import annotations

import os

import pytest

from kforge_cli.engine.plan.cost_model import HARDWARE, bubble_share, cost_constants
from kforge_cli.engine.plan.layouts import layout_of
from kforge_cli.engine.plan.param_shards import build_template, chunk_size
from kforge_cli.engine.plan.planner import GIB, build_plan
from kforge_cli.engine.plan.search import format_search, predict_layout, search_layouts
from kforge_cli.engine.plan.sharded_model import build_meta, fake_process_group
from kforge_cli.engine.runtime.mesh import mesh_shape
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, load_settings, resolve_dims

SMALL = [
    "--model.dim=128",
    "--model.n_layers=8",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.vocab_size=1000",
    "--train.seq_len=256",
    "--model.max_seq_len=256",
    "--train.batch_size=2",
    "--train.grad_accum_steps=4",
    "--slurm.gpus_per_node=8",
    "--slurm.gpu_type=h100",
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
]


MEMORY = "--slurm.gpu_memory_gb=2.1"


def _settings(*overrides: str, profile: str | None = None) -> JobSettings:
    return load_settings(profile=profile, overrides=list(overrides), use_env=False).settings


def _coords(dims, rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, size in reversed(mesh_shape(dims)):
        out[name] = rank % size
        rank //= size
    return out


def test_chunk_size_is_torch_chunk() -> None:
    import torch

    for n in (1, 7, 8, 125, 128256):
        for parts in (1, 2, 3, 8, 64, 1024):
            sizes = [c.shape[0] for c in torch.empty(n).chunk(parts)]
            sizes += [0] * (parts - len(sizes))
            assert [chunk_size(n, parts, i) for i in range(parts)] == sizes, (n, parts)


LAYOUTS = {
    "tp2_fsdp2_uneven_vocab": (["--distributed.tp=2"], 4),
    "fsdp7_uneven": (["--model.dim=96", "--model.n_heads=3", "--model.n_kv_heads=3"], 7),
    "tp2_pp2_interleaved_v2": (
        [
            "--distributed.tp=2",
            "--distributed.pp=2",
            "--distributed.pp_schedule=interleaved_1f1b",
            "--distributed.pp_stages_per_rank=2",
        ],
        8,
    ),
    "cp2_hsdp": (["--distributed.cp=2", "--distributed.dp_replicate=2"], 8),
    "moe_ep2_tp2_dense_first": (
        [
            "--model.moe.num_experts=4",
            "--model.moe.first_dense_layers=1",
            "--model.moe.num_shared_experts=1",
            "--distributed.ep=2",
            "--distributed.tp=2",
        ],
        8,
    ),
    "moe_ep4_zbv": (
        [
            "--model.moe.num_experts=4",
            "--distributed.ep=4",
            "--distributed.pp=2",
            "--distributed.pp_schedule=zbv_zero_bubble",
            "--distributed.pp_stages_per_rank=2",
            "--train.activation_checkpointing=none",
        ],
        8,
    ),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_template_shards_equal_the_meta_build_on_every_rank(case: str) -> None:
    overrides, world = LAYOUTS[case]
    s = _settings("--model.vocab_size=1000", "--train.grad_accum_steps=4", *overrides)
    dims = resolve_dims(s, world)
    template = build_template(s)
    for rank in range(world):
        with fake_process_group(world, rank):
            real = build_meta(s, dims, rank)
        coords = _coords(dims, rank)
        mine = template.build(s, dims, coords.get("pp", 0), coords)
        assert sorted(mine.params, key=lambda p: p.name) == sorted(real.params, key=lambda p: p.name), rank
        assert (mine.block_ids, mine.rank_stages, mine.has_embedding, mine.has_head) == (
            real.block_ids,
            real.rank_stages,
            real.has_embedding,
            real.has_head,
        )
        assert mine.coordinates == real.coordinates


def _plan_peak(settings: JobSettings, world: int) -> int:
    """The memory plan's worst peak over the ranks at dp/tp/cp coordinate 0 (their chunks are the largest)."""
    dims = resolve_dims(settings, world)
    per_pp = world // dims.pp
    return max(build_plan(settings, world, r * per_pp).peak_bytes for r in range(dims.pp))


@pytest.fixture(scope="module")
def small_search():
    # 2.1 GB per GPU, 2 GiB of which the CUDA allowance: the memory plan rejects the fastest layouts.
    s = _settings(*SMALL, MEMORY)
    return s, search_layouts(s, 8, top=6, memory_share=1.0)


def test_every_layout_found_passes_validate_config_and_has_the_plans_peak(small_search) -> None:
    s, result = small_search
    assert len(result.top) == 6 and result.fastest_rejected is not None
    limit = result.memory_limit_bytes
    assert limit == int(2.1 * GIB) and result.too_big > 10
    times = [c.estimate.step_s for c in result.top]
    assert times == sorted(times)
    for cand in result.top:
        again = _settings(*SMALL, MEMORY, *cand.layout.overrides())
        dims = resolve_dims(again, 8)  # raises ConfigError when validate-config would refuse it
        assert dims == cand.dims
        assert again.train.tokens_per_step(dims.dp) == s.train.tokens_per_step(8)  # the global batch is kept
        assert cand.peak_bytes == _plan_peak(again, 8) <= limit


def test_a_layout_the_memory_plan_rejects_never_appears(small_search) -> None:
    _, result = small_search
    layout, estimate, _, _ = result.fastest_rejected
    rejected = _settings(*SMALL, MEMORY, *layout.overrides())
    assert _plan_peak(rejected, 8) > result.memory_limit_bytes  # the plan itself refuses it
    assert estimate.step_s < result.top[0].estimate.step_s  # faster than anything returned...
    assert layout not in [c.layout for c in result.top]  # ...yet not returned
    assert "faster, but over the memory limit" in format_search(result)


def test_top_layouts_are_the_fastest_of_distinct_meshes(small_search) -> None:
    _, result = small_search
    families = [c.layout.family() for c in result.top]
    assert len(set(families)) == len(families)
    assert result.top[0].reason.startswith("fastest: ")
    assert all(c.reason.startswith("+") for c in result.top[1:])


def test_predict_layout_matches_the_search(small_search) -> None:
    _, result = small_search
    for cand in result.top[:3]:
        again = _settings(*SMALL, MEMORY, *cand.layout.overrides())
        estimate, peak = predict_layout(again, 8)
        assert estimate.step_s == pytest.approx(cand.estimate.step_s, rel=1e-12)
        assert peak == cand.peak_bytes
        assert layout_of(again, cand.dims) == cand.layout


def test_cost_model_compute_equals_the_plans_throughput_and_fsdp_bytes() -> None:
    """Pure FSDP over one node of 8 H100: compute = FLOPs / (8 x peak x MFU) of the plan's FLOPs count; FSDP
    moves 2 x accumulation bf16 all-gathers and one fp32 reduce-scatter of 7/8 of the parameters, at 360 GB/s;
    AdamW reads and writes 7 fp32 tensors of the rank's 1/8 of the parameters at 3.35 TB/s x 0.8."""
    s = _settings(*SMALL, "--train.batch_size=16", "--train.grad_accum_steps=2")
    estimate, _ = predict_layout(s, 8)
    plan = build_plan(s, 8, 0, mfu=0.4)
    flops = plan.throughput.flops_per_step
    assert estimate.compute_s == pytest.approx(flops / (8 * 989.4e12 * 0.4), rel=1e-9)
    assert plan.step is not None and plan.throughput.step_time_s == plan.step.step_s == estimate.step_s
    assert estimate.efficiency == 1.0  # 16 x 256 tokens per micro-batch: at full speed
    n = s.model.param_count()
    expected = (2 * 2 * 2 + 4) * n * 7 / 8 / 360e9
    assert estimate.comm["fsdp"] == pytest.approx(expected, rel=1e-9)
    assert estimate.exposed["fsdp"] == pytest.approx(0.1 * expected, rel=1e-9)  # 0.9 hidden under compute
    optimizer = 7 * 4 * s.model.param_count() / 8 / (3.35e12 * 0.8)
    assert estimate.optimizer_s == pytest.approx(optimizer, rel=1e-9)
    assert estimate.step_s == pytest.approx(estimate.compute_s + 0.1 * expected + optimizer, rel=1e-9)


def test_bubble_shares() -> None:
    assert bubble_share("1f1b", 1, 1, 8) == 0.0
    assert bubble_share("1f1b", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_share("gpipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_share("interleaved_1f1b", 4, 2, 8) == pytest.approx(3 / 19)
    assert bubble_share("interleaved_zero_bubble", 4, 2, 8) == pytest.approx(3 / 51)


def test_constants_come_from_the_table_or_the_plan_section() -> None:
    c = cost_constants(_settings(*SMALL), "bf16")
    assert (c.mfu, c.intra_bps, c.inter_bps) == (0.4, 360e9, 40e9)
    assert c.sources["mfu"] == "GPU table (H100)"
    a100 = cost_constants(_settings(*SMALL, "--slurm.gpu_type=a100", "--plan.inter_node_gbps=12.5"), "bf16")
    assert (a100.mfu, a100.intra_bps, a100.inter_bps) == (0.5, 240e9, 12.5e9)
    assert a100.sources["inter_node_gbps"] == "plan.inter_node_gbps"
    assert HARDWARE["CPU"].peak_tflops is not None
    with pytest.raises(InvalidInputError, match="not in the cost model's GPU table"):
        cost_constants(_settings(*SMALL, "--slurm.gpu_type=tpu-v5", "--metrics.peak_tflops=400"), "bf16")


def test_search_refuses_what_it_cannot_do() -> None:
    s = _settings(*SMALL)
    with pytest.raises(InvalidInputError, match="not a multiple of slurm.gpus_per_node"):
        search_layouts(s, 12)
    with pytest.raises(InvalidInputError, match="--memory-share"):
        search_layouts(s, 8, memory_share=1.5)


def test_written_profile_resolves_to_the_layout(small_search, tmp_path) -> None:
    from kforge_cli.cli.plan_profile import write_best_profile

    s, result = small_search
    best = result.top[0]
    path = write_best_profile(s, best, tmp_path / "best.toml", overwrite=False)
    again = _settings(profile=str(path))
    assert again.model_dump(exclude={"profile"}) == best.settings.model_dump(exclude={"profile"})
    with pytest.raises(InvalidInputError, match="exists; choose another file or pass --overwrite"):
        write_best_profile(s, best, path, overwrite=False)
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    link = tmp_path / "link.toml"
    os.symlink(target, link)
    with pytest.raises(InvalidInputError, match="exists"):
        write_best_profile(s, best, link, overwrite=False)
    write_best_profile(s, best, link, overwrite=True)  # the link is replaced, not written through
    assert target.read_text() == "keep me" and not link.is_symlink()


def test_no_layout_of_any_mesh_breaks_a_rule() -> None:
    """Every mesh the search returns (all of them: tp = 8 is refused here, 4 KV heads) passes the rules."""
    s = _settings(*SMALL, "--distributed.reshard_after_forward=true")  # zero-bubble schedules refuse it
    result = search_layouts(s, 8, top=1000)
    assert len(result.top) > 20
    for cand in result.top:
        again = _settings(*SMALL, "--distributed.reshard_after_forward=true", *cand.layout.overrides())
        assert resolve_dims(again, 8) == cand.dims  # raises ConfigError when validate-config would refuse it
    assert result.invalid > 0
    assert all(c.dims.tp < 8 and "zero_bubble" not in c.layout.pp_schedule for c in result.top)


def test_trial_commands_local_and_under_srun(tmp_path) -> None:
    from kforge_cli.engine.trials.runner import in_slurm_allocation, trial_command

    profile, run = tmp_path / "p.toml", tmp_path / "run"
    local = trial_command(profile, run, 10, 4, 1, 4, slurm=False)
    assert local[1:6] == ["-m", "kforge_cli", "train", "--profile", str(profile)]
    assert local[-2:] == ["--nproc-per-node", "4"] and "--train.max_steps=10" in local
    srun = trial_command(profile, run, 10, 16, 2, 8, slurm=True)
    assert srun[:5] == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--kill-on-bad-exit=1"]
    assert "--nproc-per-node" not in srun and f"--train.run_dir={run}" in srun
    assert in_slurm_allocation({"SLURM_JOB_ID": "7"}) and not in_slurm_allocation(
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    )


def test_sweep_script_runs_the_search_and_trials_in_one_allocation(tmp_path, monkeypatch) -> None:
    from kforge_cli.engine.trials.runner import write_sweep_script

    monkeypatch.chdir(tmp_path)
    s = _settings(*SMALL, "--slurm.nodes=2", "--slurm.partition=gpu")
    argv = ["plan", "trial", "--best", "3", "--sbatch", "--trial-dir", "old", "--steps=20"]
    said: list[str] = []
    script, printed = write_sweep_script(s, argv, tmp_path / "sweep", say=said.append)
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=8" in text and "#SBATCH --partition=gpu" in text
    assert "--requeue" not in text
    command = text.strip().splitlines()[-1]
    assert command.endswith(f"plan trial --best 3 --steps=20 --trial-dir {tmp_path}/sweep/results")
    assert "--sbatch" not in command and "old" not in command
    assert printed == text and said == [f"wrote {script}; submit with: sbatch {script}"]
