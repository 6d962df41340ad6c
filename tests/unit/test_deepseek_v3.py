"""The DeepSeek-V3 family: exact both ways with transformers' DeepseekV3ForCausalLM, the latent KV
cache, multi-token prediction, and the settings rules that name their keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import CheckpointError, RunParts
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.families.deepseek_v3.model import DeepseekV3Transformer, MLAttention, mtp_labels
from kforge_cli.engine.families.registry import get_family
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.engine.model.generation import generate_tokens
from kforge_cli.engine.model.kv_cache import KVCache
from kforge_cli.engine.model.moe import finish_moe_step
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.engine.train.optim.scheduler import build_scheduler
from kforge_cli.engine.train.recipe import build_checkpointer
from kforge_cli.errors import ConfigError
from kforge_cli.settings import JobSettings, load_settings
from tests.helpers.tiny_run import tiny_run

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-5
SMALL = [
    "--train.device=cpu",
    "--train.mixed_precision=fp32",
    "--model.dim=48",
    "--model.n_layers=3",
    "--model.vocab_size=96",
    "--model.max_seq_len=64",
    "--train.seq_len=32",
    "--model.ffn_hidden_dim=64",
    "--model.init_std=0.2",
    "--model.mla.kv_lora_rank=16",
    "--model.mla.q_lora_rank=24",
    "--model.mla.qk_rope_head_dim=8",
    "--model.mla.qk_nope_head_dim=12",
    "--model.mla.v_head_dim=10",
    "--model.moe.expert_hidden_dim=24",
]
PROMPT = [5, 17, 3, 42, 8]


def settings(*extra: str) -> JobSettings:
    return load_settings(profile="deepseek-v3-debug", overrides=[*SMALL, *extra], use_env=False).settings


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, JobSettings]:
    """3 AdamW steps (LM + MTP loss, the balancing bias moved), a checkpoint, and its export."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dsv3")
    s = settings("--model.moe.bias_update_rate=0.02")
    run = tiny_run(root / "run", s)
    model = run.model
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        tokens = torch.randint(0, 96, (2, 17), generator=gen)
        logits = model(tokens[:, :-1])
        labels = tokens[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        mtp = model.mtp_outputs[0]
        loss = loss + 0.3 * F.cross_entropy(mtp.flatten(0, 1), mtp_labels(labels, 1).flatten(), ignore_index=-100)
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        finish_moe_step(model)
        run.state.step = step
    ckpt = run.manager.save(3, blocking=True)
    hf_dir = export_hf(ckpt, root / "hf", tokenizer="none").out_dir
    return ckpt, hf_dir, s


def tokens() -> torch.Tensor:
    return torch.randint(0, 96, (3, 30), generator=torch.Generator().manual_seed(7))


def test_export_hf_loads_in_transformers_with_the_same_logits_and_comes_back(
    trained: tuple[Path, Path, JobSettings], caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, hf_dir, _ = trained
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 0 and config["rope_interleave"] is False
    ours_model = load_model(ckpt)
    assert isinstance(ours_model, DeepseekV3Transformer) and ours_model.mtp is not None  # MTP in the checkpoint
    bias = ours_model.state_dict()["layers.1.feed_forward.expert_bias"]
    assert float(bias.abs().max()) >= 0.02  # balancing moved the selection bias: the comparison sees it
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert not any("mtp" in k for k in hf.state_dict())
    toks = tokens()
    with torch.no_grad():
        ours, theirs = ours_model(toks), hf(toks).logits
        rel = max_rel_diff(ours, theirs)
        print(f"export-hf deepseek_v3: fp32 max rel logit diff {rel:.3e}")
        assert rel <= REL_TOL
        back = load_model(hf_dir)  # and back: load_model reads the export (no MTP: transformers has none)
        assert isinstance(back, DeepseekV3Transformer) and back.mtp is None
        assert max_rel_diff(ours, back(toks)) <= REL_TOL


def test_import_from_transformers_warm_starts_and_trains_on(
    trained: tuple[Path, Path, JobSettings], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, hf_dir, _ = trained
    warm = settings(f"--checkpoint.init_from={hf_dir}")
    runtime = init_runtime(warm)
    model, _ = build_parallel_model(warm, runtime)
    opt = build_optimizer(model, warm.optimizer)
    parts = RunParts(
        model, opt, build_scheduler(opt, warm.scheduler, warm.train.max_steps, warm.data.phases), TrainState()
    )
    with caplog.at_level("WARNING", logger="kforge"):
        restored = build_checkpointer(warm, runtime, tmp_path / "run", parts).restore()
    assert restored is not None and restored.kind == "warm_start"
    assert "21 tensors (mtp.*) have no counterpart" in caplog.text and "fresh initialisation" in caplog.text
    toks = tokens()
    with torch.no_grad():
        assert max_rel_diff(load_model(ckpt)(toks), model.eval()(toks)) <= REL_TOL
    model.train()
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 96, (1, 33), generator=gen).repeat(4, 1)
    losses = []
    for _ in range(5):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        mtp = model.mtp_outputs[0]
        (loss + 0.3 * F.cross_entropy(mtp.flatten(0, 1), mtp_labels(batch[:, 1:], 1).flatten())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_deepseek_checkpoint_with_interleaved_rope_imports_exactly(tmp_path: Path) -> None:
    """DeepSeek's own checkpoints rotate interleaved pairs (``rope_interleave = true``): rows are permuted."""
    torch.manual_seed(3)
    config = transformers.DeepseekV3Config(
        vocab_size=90, hidden_size=40, intermediate_size=56, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64, rope_interleave=True, initializer_range=0.2,
    )  # fmt: skip
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = load_model(tmp_path / "hf")
    toks = torch.randint(0, 90, (2, 25), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rel = max_rel_diff(ours(toks), hf(toks).logits)
    print(f"import interleaved-RoPE DeepseekV3: fp32 max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL


def test_rope_scaling_is_refused_by_name(tmp_path: Path) -> None:
    config = transformers.DeepseekV3Config(
        vocab_size=90, hidden_size=40, intermediate_size=56, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, kv_lora_rank=12, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=6, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale_all_dim": 1.0},
    )  # fmt: skip
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="rope scaling 'yarn'"):
        load_model(tmp_path / "hf")


def test_generate_caches_the_latent_and_equals_transformers_greedy(trained: tuple[Path, Path, JobSettings]) -> None:
    ckpt, hf_dir, _ = trained
    model = load_model(ckpt)
    cached = list(generate_tokens(model, PROMPT, max_new_tokens=30, use_cache=True))
    assert cached == list(generate_tokens(model, PROMPT, max_new_tokens=30, use_cache=False))
    assert len(set(cached)) > 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(PROMPT) :].tolist() == cached
    # the cache holds each MLA layer's normed latent and rotated key, not per-head keys and values
    cache = KVCache(16)
    seq = torch.tensor([PROMPT + cached[:11]])
    with torch.no_grad():
        reference = model(seq)
        pieces = [model(seq[:, :5], kv_cache=cache)]
        pieces += [model(seq[:, i : i + 1], kv_cache=cache) for i in range(5, 10)]
        pieces.append(model(seq[:, 10:16], kv_cache=cache))  # a multi-token chunk after the cache
    torch.testing.assert_close(torch.cat(pieces, 1), reference, rtol=1e-5, atol=1e-5)
    attn = [m for m in model.layers.modules() if isinstance(m, MLAttention)]  # MTP modules do not decode
    stored = [tuple(t.shape) for m in attn for t in cache._store[id(m)]]
    assert stored == [(1, 16, 16), (1, 16, 1, 8)] * len(attn)  # kv_lora_rank 16, qk_rope_head_dim 8


def test_mtp_outputs_are_causal_per_depth() -> None:
    """Depth k at position i reads token i + k: shifting ids (with wrap-around) changes no earlier position."""
    s = settings("--model.mtp_depth=2")
    torch.manual_seed(0)
    model = get_family("deepseek_v3").build(s.model).train()
    toks = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(toks)
        full = [t.clone() for t in model.mtp_outputs]
        model(toks[:, :14])
        short = model.mtp_outputs
    assert len(full) == 2
    for k, (f, sh) in enumerate(zip(full, short, strict=True), start=1):
        torch.testing.assert_close(sh[:, : 14 - k], f[:, : 14 - k], rtol=1e-4, atol=1e-5)
    labels = torch.arange(6).view(1, 6)
    assert mtp_labels(labels, 2).tolist() == [[2, 3, 4, 5, -100, -100]]
    model.eval()
    with torch.no_grad():
        model(toks)
    assert model.mtp_outputs == [] or model.mtp_outputs[0].shape[1] == 14  # eval forwards run no MTP


def test_param_count_matches_the_built_model() -> None:
    base = settings().model
    assert base.mla is not None
    direct_q = base.model_copy(update={"mla": base.mla.model_copy(update={"q_lora_rank": None}), "mtp_depth": 2})
    for cfg in (base, direct_q):
        model = get_family("deepseek_v3").meta_model(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.param_count()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["--model.n_kv_heads=2"], "model.n_kv_heads"),
        (["--model.qk_norm=true"], "model.qk_norm"),
        (["--distributed.pp=2", "--model.n_layers=4"], "model.mtp_depth"),
        (["--distributed.cp=2"], "model.mtp_depth"),
        (["--model.mla.qk_rope_head_dim=7"], "model.mla.qk_rope_head_dim"),
    ],
)
def test_rules_name_the_key(extra: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings(*extra)
    assert key in str(err.value)


def test_mla_and_mtp_belong_to_the_family() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=["--model.mtp_depth=1", "--model.mla.kv_lora_rank=8"], use_env=False)
    assert "model.mtp_depth" in str(err.value) and "model.mla" in str(err.value)


def test_llama_fingerprints_do_not_see_the_new_fields() -> None:
    """Runs written before the family existed resume: the DeepSeek-V3 fields at their defaults are not shaping."""
    from kforge_cli.rundir.fingerprint import shaping_config

    llama = shaping_config(load_settings(use_env=False).settings)
    assert not any(k in llama for k in ("model.family", "model.mla", "model.mtp_depth", "model.mtp_loss_weight"))
    ours = shaping_config(settings())
    assert ours["model.family"] == "deepseek_v3" and ours["model.mtp_depth"] == 1
    assert ours["model.mla"]["kv_lora_rank"] == 16 and "model.mtp_loss_weight" not in ours


def test_plan_of_the_16b_profile_is_exact_against_the_meta_build() -> None:
    """HSDP 8 x (dp_shard 8 = ep 8): experts split 8 ways by EP, every other tensor FSDP-sharded 8 ways
    (dim 0 padded up), fp32 master weights and AdamW's two moments plus a step counter per tensor."""
    import math

    from kforge_cli.engine.plan.planner import build_plan

    s = load_settings(profile="deepseek-v3-16b-h100x64", use_env=False).settings
    model = get_family("deepseek_v3").meta_model(s.model)
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == s.model.param_count() == 16_299_726_848
    local = sum(
        p.numel() // 8 if ".experts." in name else math.ceil(p.shape[0] / 8) * (p.numel() // p.shape[0])
        for name, p in params.items()
    )
    for rank in (0, 63):
        plan = build_plan(s, 64, rank)
        assert plan.total_params == s.model.param_count()
        assert plan.local_params == local == 2_037_465_856
        assert plan.item("parameters").bytes == 4 * local
        assert plan.item("optimizer state").bytes == 2 * 4 * local + 4 * len(params)
        assert plan.fits
