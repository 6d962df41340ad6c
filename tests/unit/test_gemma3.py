"""The Gemma 3 family (text): exact both ways with transformers' Gemma3ForCausalLM (and the language
model of a Gemma3ForConditionalGeneration), greedy generation with a sliding-window KV cache, the
sliding-window masks (dense, create_mask, FlexAttention) and the settings rules that name their keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import RunParts
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.families.gemma3.model import Gemma3Transformer
from kforge_cli.engine.families.registry import get_family
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.engine.model.attention_mask import attend, build_attention_mask, document_causal_mask
from kforge_cli.engine.model.generation import generate_tokens
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
    "--model.n_layers=5",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=96",
    "--model.max_seq_len=64",
    "--train.seq_len=32",
    "--model.ffn_hidden_dim=64",
    "--model.init_std=0.02",
    "--model.gemma3.head_dim=16",  # not dim / n_heads (12), as in Gemma 3 4B
    "--model.gemma3.sliding_window=6",
    "--model.gemma3.global_every=2",
    "--model.gemma3.query_pre_attn_scalar=20",
]
PROMPT = list(range(3, 40, 3))  # 13 tokens: longer than the window of 6


def settings(*extra: str) -> JobSettings:
    return load_settings(profile="gemma3-debug", overrides=[*SMALL, *extra], use_env=False).settings


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def tokens() -> torch.Tensor:
    return torch.randint(0, 96, (3, 30), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, JobSettings]:
    """Norm weights drawn away from zero, 3 AdamW steps, a checkpoint, and its export."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gemma3")
    s = settings()
    run = tiny_run(root / "run", s)
    with torch.no_grad():  # Gemma's norms start at zero; 3 small steps barely move them: make (1 + weight) visible
        for name, p in run.model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        toks = torch.randint(0, 96, (2, 25), generator=gen)
        loss = F.cross_entropy(run.model(toks[:, :-1]).flatten(0, 1), toks[:, 1:].flatten())
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.state.step = step
    ckpt = run.manager.save(3, blocking=True)
    hf_dir = export_hf(ckpt, root / "hf", tokenizer="none").out_dir
    return ckpt, hf_dir, s


def test_export_hf_loads_in_transformers_with_the_same_logits_and_comes_back(
    trained: tuple[Path, Path, JobSettings],
) -> None:
    ckpt, hf_dir, _ = trained
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert config["head_dim"] == 16 and config["sliding_window"] == 6 and config["query_pre_attn_scalar"] == 20
    ours_model = load_model(ckpt)
    assert isinstance(ours_model, Gemma3Transformer)
    norm = ours_model.state_dict()["layers.0.post_attention_norm.weight"]
    assert float(norm.abs().max()) > 0.1  # away from zero: the (1 + weight) scaling is compared
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    toks = tokens()
    with torch.no_grad():
        ours, theirs = ours_model(toks), hf(toks).logits
        rel = max_rel_diff(ours, theirs)
        print(f"export-hf gemma3: fp32 max rel logit diff {rel:.3e}")
        assert rel <= REL_TOL
        back = load_model(hf_dir)
        assert isinstance(back, Gemma3Transformer)
        assert max_rel_diff(ours, back(toks)) <= REL_TOL
        # the window matters at 30 tokens: all-global layers compute something else
        wide = load_model(ckpt)
        for block in wide.layers.values():
            block.is_global = True
        assert max_rel_diff(ours, wide(toks)) > 1e-3


def test_import_from_transformers_warm_starts_and_trains_on(tmp_path: Path) -> None:
    torch.manual_seed(3)
    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5, query_pre_attn_scalar=16,
        sliding_window_pattern=2, rope_theta=50_000.0, rope_local_base_freq=5_000.0, initializer_range=0.2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},  # as Gemma 3 4B's global layers
    )  # fmt: skip
    assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)  # Gemma's norms start at zero: make (1 + weight) visible
    hf.save_pretrained(str(tmp_path / "hf"))
    toks = tokens()
    with torch.no_grad():
        rel = max_rel_diff(load_model(tmp_path / "hf")(toks), hf(toks).logits)
    print(f"import Gemma3ForCausalLM: fp32 max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL
    warm = load_settings(
        overrides=[
            *SMALL[:2], "--model.family=gemma3", "--model.dim=48", "--model.n_layers=4", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--model.vocab_size=96", "--model.max_seq_len=64", "--train.seq_len=32",
            "--model.ffn_hidden_dim=64", "--model.activation=gelu", "--model.qk_norm=true",
            "--model.tie_embeddings=true", "--model.norm_eps=1e-6", "--model.rope_theta=50000",
            "--model.gemma3.head_dim=16", "--model.gemma3.sliding_window=5", "--model.gemma3.global_every=2",
            "--model.gemma3.rope_local_theta=5000", "--model.gemma3.query_pre_attn_scalar=16",
            "--model.gemma3.rope_linear_factor=8",
            f"--checkpoint.init_from={tmp_path / 'hf'}",
        ],
        use_env=False,
    ).settings  # fmt: skip
    runtime = init_runtime(warm)
    model, _ = build_parallel_model(warm, runtime)
    opt = build_optimizer(model, warm.optimizer)
    parts = RunParts(
        model, opt, build_scheduler(opt, warm.scheduler, warm.train.max_steps, warm.data.phases), TrainState()
    )
    restored = build_checkpointer(warm, runtime, tmp_path / "run", parts).restore()
    assert restored is not None and restored.kind == "warm_start"
    with torch.no_grad():
        assert max_rel_diff(model.eval()(toks), hf(toks).logits) <= REL_TOL
    model.train()
    batch = torch.randint(0, 96, (1, 33), generator=torch.Generator().manual_seed(1)).repeat(4, 1)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_multimodal_checkpoint_imports_its_language_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration: the text model is read, the vision tower and projector skipped."""
    torch.manual_seed(4)
    text = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4, sliding_window_pattern=3,
        query_pre_attn_scalar=16, initializer_range=0.2,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    vlm = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in vlm.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0.0, 0.3)
    vlm.save_pretrained(str(tmp_path / "hf"))
    ours = load_model(tmp_path / "hf")
    assert isinstance(ours, Gemma3Transformer) and ours.cfg.gemma3 is not None
    assert ours.cfg.gemma3.global_every == 3 and ours.cfg.gemma3.sliding_window == 4
    toks = tokens()
    with torch.no_grad():
        rel = max_rel_diff(ours(toks), vlm(input_ids=toks).logits)
    print(f"import Gemma3ForConditionalGeneration (text): fp32 max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL


def test_generate_with_the_sliding_window_cache_equals_transformers_greedy(
    trained: tuple[Path, Path, JobSettings],
) -> None:
    ckpt, hf_dir, _ = trained
    model = load_model(ckpt)
    cached = list(generate_tokens(model, PROMPT, max_new_tokens=30, use_cache=True))
    assert cached == list(generate_tokens(model, PROMPT, max_new_tokens=30, use_cache=False))
    assert len(set(cached)) > 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(PROMPT) :].tolist() == cached


def _dense_reference(doc_ids: torch.Tensor, window: int) -> torch.Tensor:
    t = doc_ids.shape[1]
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    return document_causal_mask(doc_ids) & ((k <= q) & (k > q - window))[None, None]


def test_sliding_window_masks_dense_create_mask_and_flex_agree() -> None:
    """On CPU: the dense mask, the block mask's own mask_mod through torch's create_mask, and a
    FlexAttention forward with the block mask equal the dense SDPA path (with document masking)."""
    from torch.nn.attention.flex_attention import create_mask

    torch.manual_seed(0)
    b, h, t, d, window = 2, 4, 256, 16, 40
    doc_ids = torch.zeros(b, t, dtype=torch.long)
    doc_ids[0, 100:] = 1
    doc_ids[1, 30:] = 1
    doc_ids[1, 200:] = 2
    ref = _dense_reference(doc_ids, window)
    dense = build_attention_mask("sdpa", (b, t), torch.device("cpu"), doc_ids, window=window)
    assert dense.kind == "dense" and torch.equal(dense.dense, ref)
    plain = build_attention_mask("sdpa", (b, t), torch.device("cpu"), None, window=window)
    assert plain.kind == "causal" and torch.equal(
        plain.dense, _dense_reference(torch.zeros(1, t, dtype=torch.long), window)
    )
    flex = build_attention_mask("flex", (b, t), torch.device("cpu"), doc_ids, window=window)
    assert flex.kind == "flex"
    bm = flex.block_mask
    assert torch.equal(create_mask(bm.mask_mod, b, None, t, t, device="cpu"), ref)
    assert torch.equal(bm.to_dense().bool().any(), torch.tensor(True))
    q, k, v = (torch.randn(b, h if i == 0 else 2, t, d) for i in range(3))
    with torch.no_grad():
        out_dense = attend(q, k, v, dense, scale=0.3)
        out_flex = attend(q, k, v, flex, scale=0.3)
    torch.testing.assert_close(out_flex, out_dense, rtol=1e-5, atol=1e-5)
    # fully masked tiles are skipped: a 40-token window over 128-token blocks leaves block (1, 0) out
    blocks = bm.to_dense()[1, 0]
    assert blocks.shape == (2, 2) and int(blocks[1, 0]) == 1 and int(blocks[0, 1]) == 0


@pytest.mark.gpu
def test_sliding_window_flex_backward_equals_dense_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, h, t, d, window = 2, 4, 512, 64, 100
    doc_ids = torch.zeros(b, t, dtype=torch.long, device=dev)
    doc_ids[0, 300:] = 1
    doc_ids[1, 60:] = 1
    grads = []
    for backend in ("sdpa", "flex"):
        mask = build_attention_mask(backend, (b, t), dev, doc_ids, window=window)
        q, k, v = (torch.randn(b, h, t, d, device=dev, generator=torch.Generator(dev).manual_seed(i)) for i in range(3))
        for x in (q, k, v):
            x.requires_grad_(True)
        out = attend(q, k, v, mask, scale=0.2)
        (out * torch.linspace(-1, 1, d, device=dev)).sum().backward()
        grads.append([out.detach(), q.grad, k.grad, v.grad])
    for a, b_ in zip(*grads, strict=True):
        torch.testing.assert_close(b_, a, rtol=2e-4, atol=2e-4)


def test_param_count_matches_the_built_model() -> None:
    for s in (
        settings(),
        settings("--model.tie_embeddings=false"),
        load_settings(profile="gemma3-debug", use_env=False).settings,
    ):
        model = get_family("gemma3").meta_model(s.model)
        assert sum(p.numel() for p in model.parameters()) == get_family("gemma3").param_count(s.model)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["--model.activation=swiglu"], "model.activation"),
        (["--model.qk_norm=false"], "model.qk_norm"),
        (["--model.norm=layernorm"], "model.norm"),
        (["--model.gemma3.head_dim=15"], "model.gemma3.head_dim"),
        (["--model.gemma3.global_every=0"], "model.gemma3.global_every"),
        (["--model.gemma3.final_logit_softcapping=30", "--train.loss_chunk_size=16"], "train.loss_chunk_size"),
        (["--distributed.cp=2", "--distributed.cp_attention=ring"], "model.gemma3.sliding_window"),
    ],
)
def test_rules_name_the_key(extra: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings(*extra)
    assert key in str(err.value)


def test_final_logit_softcapping_trains_with_full_logits() -> None:
    s = settings("--model.gemma3.final_logit_softcapping=3")
    torch.manual_seed(0)
    model = get_family("gemma3").build(s.model)
    logits = model(tokens())
    assert float(logits.abs().max()) <= 3.0 and s.train.loss_chunk_size == 0


def test_gemma3_settings_belong_to_the_family() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=["--model.gemma3.sliding_window=8"], use_env=False)
    assert "model.gemma3" in str(err.value)


def test_llama_fingerprints_do_not_see_the_new_section() -> None:
    from kforge_cli.rundir.fingerprint import shaping_config

    assert "model.gemma3" not in shaping_config(load_settings(use_env=False).settings)
    assert shaping_config(settings())["model.gemma3"]["sliding_window"] == 6


def test_plan_of_the_4b_profile_is_exact_against_the_meta_build() -> None:
    """FSDP over 8 GPUs: every tensor sharded 8 ways along dim 0 (padded up), fp32 master weights,
    AdamW's two fp32 moments plus a step counter per tensor; Gemma 3 4B's text model is 3.88B."""
    import math

    from kforge_cli.engine.plan.planner import build_plan

    s = load_settings(profile="gemma3-4b-h100x8", use_env=False).settings
    family = get_family("gemma3")
    params = dict(family.meta_model(s.model).named_parameters())
    assert sum(p.numel() for p in params.values()) == family.param_count(s.model) == 3_880_263_168
    local = sum(math.ceil(p.shape[0] / 8) * (p.numel() // p.shape[0]) for p in params.values())
    for rank in (0, 7):
        plan = build_plan(s, 8, rank)
        assert plan.total_params == family.param_count(s.model)
        assert plan.local_params == local == 485_032_896
        assert plan.item("parameters").bytes == 4 * local
        assert plan.item("optimizer state").bytes == 2 * 4 * local + 4 * len(params)
        assert plan.fits
