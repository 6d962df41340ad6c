"""Every MoE router kforge trains exports to the transformers architecture that holds it, and reads back.

The shipped ``moe-debug`` and (shape-reduced) ``moe16b`` profiles, plus the router options
they do not use (group-limited routing, routed scaling, no shared experts, QK-norm), are
trained for a few steps with aux-loss-free balancing turned up so the selection bias is
far from zero, exported, loaded by ``AutoModelForCausalLM`` and compared in fp32: logits
within 1e-5 of the largest. Zeroing the exported bias must move the logits by far more,
so the comparison would notice a bias that is dropped or applied the wrong way. The
export then loads back through ``load_model`` and ``checkpoint.init_from``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import CheckpointError, RunParts
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.engine.model.moe import finish_moe_step
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.engine.train.optim.scheduler import build_scheduler
from kforge_cli.engine.train.recipe import build_checkpointer
from kforge_cli.settings import JobSettings, load_settings
from tests.helpers.tiny_run import tiny_run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REL_TOL = 1e-5
CPU = [
    "--model.vocab_size=64",
    "--model.max_seq_len=32",
    "--train.seq_len=16",
    "--train.batch_size=2",
    "--train.device=cpu",
    "--train.mixed_precision=fp32",
    "--train.grad_accum_steps=1",
    "--train.activation_checkpointing=none",
    "--distributed.ep=1",
    "--distributed.dp_shard=1",
    "--distributed.dp_replicate=1",
    "--checkpoint.async_mode=disabled",
    "--checkpoint.keep_last_n=0",
    "--optimizer.lr=1e-2",
    "--scheduler.warmup_steps=1",
    "--model.moe.bias_update_rate=0.02",  # a bias that changes which experts tokens pick
]
SMALL = ["--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.moe.expert_hidden_dim=16"]
# moe16b-h100x8 with its widths cut down: 64 experts top-6, 2 shared, MHA, 1 dense block
MOE16B = [
    "--model.dim=64",
    "--model.n_layers=3",
    "--model.n_heads=4",
    "--model.n_kv_heads=4",
    "--model.ffn_hidden_dim=96",
    "--model.moe.expert_hidden_dim=8",
]
CASES = {
    "moe-debug": ("moe-debug", SMALL, "Ernie4_5_MoeForCausalLM"),
    "moe16b": ("moe16b-h100x8", MOE16B, "Glm4MoeForCausalLM"),
    "sigmoid-groups-scaled-qknorm": (
        "moe-debug",
        [
            *SMALL,
            "--model.qk_norm=true",
            "--model.moe.score_func=sigmoid",
            "--model.moe.num_shared_experts=2",
            "--model.moe.n_groups=4",
            "--model.moe.topk_groups=2",
            "--model.moe.route_scale=2.5",
        ],
        "Glm4MoeForCausalLM",
    ),
    "sigmoid-no-shared-no-renorm": (
        "moe-debug",
        [
            *SMALL,
            "--model.moe.score_func=sigmoid",
            "--model.moe.num_shared_experts=0",
            "--model.moe.renormalize=false",
        ],
        "Glm4MoeForCausalLM",
    ),
    "softmax-qknorm-scaled": (
        "moe-debug",
        [
            *SMALL,
            "--model.qk_norm=true",
            "--model.moe.num_shared_experts=0",
            "--model.moe.bias_update_rate=0",
            "--model.moe.route_scale=2.0",
            "--model.moe.renormalize=false",
        ],
        "Qwen3MoeForCausalLM",
    ),
}


def settings(profile: str, extra: list[str]) -> JobSettings:
    return load_settings(profile=profile, overrides=[*CPU, *extra], use_env=False).settings


def train_moe_and_save(run_dir: Path, s: JobSettings, steps: int = 3) -> Path:
    """`steps` AdamW steps on random tokens, each finished like training's (bias update), then a checkpoint."""
    run = tiny_run(run_dir, s)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 64, (2, 17), generator=gen)
        logits = run.model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        finish_moe_step(run.model)
        run.scheduler.step()
        run.state.step = step
    return run.manager.save(steps, blocking=True)


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (3, 30), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("case", list(CASES))
def test_moe_exports_to_the_architecture_that_holds_it(tmp_path: Path, case: str) -> None:
    profile, extra, hf_class = CASES[case]
    s = settings(profile, extra)
    step = train_moe_and_save(tmp_path / "run", s)
    uses_bias = s.model.moe is not None and s.model.moe.bias_update_rate > 0
    if uses_bias:
        bias = load_model(step).state_dict()["layers.1.feed_forward.expert_bias"]
        assert float(bias.abs().max()) >= 0.02  # balancing moved it
    result = export_hf(step, tmp_path / "hf", max_shard_bytes=200_000)
    assert result.hf_class == hf_class
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [hf_class]
    toks = tokens()
    with torch.no_grad():
        ours = load_model(step)(toks)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        theirs = hf(toks).logits
    assert type(hf).__name__ == hf_class
    rel = max_rel_diff(ours, theirs)
    print(f"export-hf {case}: {hf_class}, fp32 max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL
    if uses_bias:  # the comparison sees the bias: without it the logits move far beyond the tolerance
        with torch.no_grad():
            for name, buf in hf.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.zero_()
            for name, p in hf.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.zero_()
            assert max_rel_diff(ours, hf(toks).logits) > 100 * REL_TOL
    with torch.no_grad():  # and back: load_model reads the export ...
        back = load_model(tmp_path / "hf")
        assert max_rel_diff(ours, back(toks)) <= REL_TOL
    # ... and checkpoint.init_from warm-starts a run of the same model from it
    folded = s.model.moe is not None and s.model.moe.route_scale != 1 and hf_class != "Glm4MoeForCausalLM"
    if folded:  # route_scale went into down_proj: the same model is one with route_scale = 1
        with pytest.raises(CheckpointError, match="moe.route_scale: run has 2.0, hf has 1.0"):
            warm_start(tmp_path, profile, extra)
        extra = [*extra, "--model.moe.route_scale=1"]
    model = warm_start(tmp_path, profile, extra)
    with torch.no_grad():
        assert max_rel_diff(ours, model.eval()(toks)) <= REL_TOL


def warm_start(tmp_path: Path, profile: str, extra: list[str]) -> torch.nn.Module:
    """A run of `profile` + `extra` with checkpoint.init_from = tmp_path/hf, restored (step 0)."""
    warm = load_settings(
        profile=profile, overrides=[*CPU, *extra, f"--checkpoint.init_from={tmp_path / 'hf'}"], use_env=False
    ).settings
    runtime = init_runtime(warm)
    model, _ = build_parallel_model(warm, runtime)
    opt = build_optimizer(model, warm.optimizer)
    parts = RunParts(
        model, opt, build_scheduler(opt, warm.scheduler, warm.train.max_steps, warm.data.phases), TrainState()
    )
    restored = build_checkpointer(warm, runtime, tmp_path / "run2", parts).restore()
    assert restored is not None and restored.kind == "warm_start"
    return model


def test_what_no_architecture_holds_is_refused_with_the_fields_named(tmp_path: Path) -> None:
    s = settings("moe-debug", [*SMALL, "--model.qk_norm=true"])  # softmax + bias + shared + QK-norm
    step = train_moe_and_save(tmp_path / "run", s, steps=1)
    with pytest.raises(CheckpointError, match="no transformers MoE architecture") as info:
        export_hf(step, tmp_path / "hf")
    message = str(info.value)
    for field in ("model.qk_norm = true", "model.moe.num_shared_experts", "model.moe.score_func = 'softmax'"):
        assert field in message, message
    for cls in ("Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "Ernie4_5_MoeForCausalLM"):
        assert cls in message
    assert not (tmp_path / "hf").exists()
    s = settings("moe16b-h100x8", [*MOE16B, "--model.moe.capacity_factor=1.25"])
    step = train_moe_and_save(tmp_path / "run2", s, steps=1)
    with pytest.raises(CheckpointError, match="model.moe.capacity_factor"):
        export_hf(step, tmp_path / "hf")


def test_dense_qk_norm_exports_as_qwen3(tmp_path: Path) -> None:
    s = load_settings(
        overrides=[*CPU[:-1], "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.qk_norm=true"],
        use_env=False,
    ).settings
    step = train_moe_and_save(tmp_path / "run", s, steps=2)
    result = export_hf(step, tmp_path / "hf")
    assert result.hf_class == "Qwen3ForCausalLM"
    toks = tokens()
    with torch.no_grad():
        ours = load_model(step)(toks)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        rel = max_rel_diff(ours, hf(toks).logits)
        print(f"export-hf dense qk_norm: Qwen3ForCausalLM, fp32 max rel logit diff {rel:.3e}")
        assert type(hf).__name__ == "Qwen3ForCausalLM" and rel <= REL_TOL
        assert max_rel_diff(ours, load_model(tmp_path / "hf")(toks)) <= REL_TOL
