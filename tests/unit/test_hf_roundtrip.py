"""kforge <-> Hugging Face Llama: export, load with transformers, warm start from a transformers-made directory.

Equality of logits (fp32, relative to the largest logit) is the test of the weight
layout: a missing or wrong q/k RoPE permutation, a swapped gate/up projection or a
mis-mapped norm would each move the logits by far more than the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import CheckpointError, RunParts
from kforge_cli.engine.checkpoint.inspection import summarize
from kforge_cli.engine.checkpoint.reader import open_checkpoint
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.engine.train.optim.scheduler import build_scheduler
from kforge_cli.engine.train.recipe import build_checkpointer
from kforge_cli.settings import load_settings
from tests.unit.test_inspect_ckpt import TINY, train_and_save

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REL_TOL = 1e-5


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def tokens(vocab: int = 64, seq: int = 30) -> torch.Tensor:
    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(7))


def hf_logits(path: Path, toks: torch.Tensor) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(toks).logits


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--model.n_kv_heads=2"], id="gqa"),
        pytest.param(["--model.n_kv_heads=1", "--model.tie_embeddings=true", "--model.rope_theta=500"], id="tied-mqa"),
    ],
)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, extra: list[str]) -> None:
    saved = train_and_save(tmp_path / "run", extra, steps=1)  # one AdamW step: norms are no longer all ones
    result = export_hf(saved.steps[1], tmp_path / "hf")
    assert result.files == ["model.safetensors"] and result.dtype == "float32" and result.step == 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == saved.settings.model.kv_heads
    assert config["tie_word_embeddings"] == saved.settings.model.tie_embeddings
    toks = tokens()
    with torch.no_grad():
        ours = load_model(saved.steps[1])(toks)
    rel = max_rel_diff(ours, hf_logits(tmp_path / "hf", toks))
    print(f"export-hf {extra}: max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL


def test_sharded_bf16_export(tmp_path: Path) -> None:
    saved = train_and_save(tmp_path / "run", [], steps=1)
    result = export_hf(saved.steps[1], tmp_path / "hf", dtype="bf16", max_shard_bytes=20_000)
    assert len(result.files) > 2 and result.dtype == "bfloat16"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result.files)
    assert index["metadata"]["total_size"] == result.params * 2
    from safetensors.torch import load_file

    first = load_file(str(tmp_path / "hf" / index["weight_map"]["model.embed_tokens.weight"]))
    emb = first["model.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, saved.weights[1]["tok_embeddings.weight"].to(torch.bfloat16))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16)
    assert torch.equal(hf.lm_head.weight, saved.weights[1]["output.weight"].to(torch.bfloat16))


def test_export_refuses_what_no_architecture_can_represent(tmp_path: Path) -> None:
    saved = train_and_save(
        tmp_path / "run", ["--model.activation=gelu", "--model.norm=layernorm", "--model.qk_norm=true"], steps=1
    )
    with pytest.raises(CheckpointError, match="cannot export") as info:
        export_hf(saved.steps[1], tmp_path / "hf")
    for word in ("model.norm = 'layernorm'", "RMSNorm", "model.activation = 'gelu'", "SwiGLU"):
        assert word in str(info.value)
    assert not (tmp_path / "hf").exists()


def test_export_will_not_overwrite_by_accident(tmp_path: Path) -> None:
    saved = train_and_save(tmp_path / "run", [], steps=1)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="--overwrite"):
        export_hf(saved.steps[1], tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="refusing to overwrite"):  # not an earlier export: never replaced
        export_hf(saved.steps[1], tmp_path / "hf", overwrite=True)
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"
    export_hf(saved.steps[1], tmp_path / "hf2")
    export_hf(saved.steps[1], tmp_path / "hf2", overwrite=True)  # an earlier export is
    names = ["config.json", "kforge_export.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == names


def make_hf_llama(path: Path, *, tied: bool, seed: int = 0) -> torch.nn.Module:
    """A random tiny Llama made and saved by transformers itself (norm weights randomised too)."""
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return model


HF_MATCH = ["--model.ffn_hidden_dim=80", "--model.rope_theta=500", "--model.norm_eps=1e-6"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_init_from_a_transformers_directory_gives_transformers_logits(tmp_path: Path, tied: bool) -> None:
    hf = make_hf_llama(tmp_path / "hf", tied=tied)
    s = load_settings(
        overrides=[
            *TINY,
            *HF_MATCH,
            f"--model.tie_embeddings={str(tied).lower()}",
            f"--checkpoint.init_from={tmp_path / 'hf'}",
        ],
        use_env=False,
    ).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    opt = build_optimizer(model, s.optimizer)
    mgr = build_checkpointer(
        s,
        runtime,
        tmp_path / "run",
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    )
    restored = mgr.restore()
    assert restored is not None and restored.kind == "warm_start" and restored.step == 0
    toks = tokens()
    with torch.no_grad():
        theirs = hf(toks).logits
        rel = max_rel_diff(model.eval()(toks), theirs)
        rel_loaded = max_rel_diff(load_model(tmp_path / "hf")(toks), theirs)
    print(f"init_from HF (tied={tied}): max rel logit diff {rel:.3e}; load_model(HF dir) {rel_loaded:.3e}")
    assert rel <= REL_TOL and rel_loaded <= REL_TOL
    ours_wk, theirs_wk = (
        model.state_dict()["layers.1.attention.wk.weight"],
        hf.state_dict()["model.layers.1.self_attn.k_proj.weight"],
    )
    assert torch.equal(ours_wk, theirs_wk)


def test_init_from_a_differently_shaped_hf_model_says_which_overrides_fit(tmp_path: Path) -> None:
    make_hf_llama(tmp_path / "hf", tied=False)
    s = load_settings(
        overrides=[*TINY, "--model.n_layers=3", f"--checkpoint.init_from={tmp_path / 'hf'}"], use_env=False
    ).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    opt = build_optimizer(model, s.optimizer)
    mgr = build_checkpointer(
        s,
        runtime,
        tmp_path / "run",
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    )
    with pytest.raises(CheckpointError, match="differently shaped") as info:
        mgr.restore()
    message = str(info.value)
    assert "n_layers: run has 3, hf has 2" in message and "resolved_ffn_hidden_dim" in message
    assert "--model.n_layers=2" in message and "--model.ffn_hidden_dim=80" in message


def test_the_logit_check_would_catch_a_rope_permutation(tmp_path: Path) -> None:
    """Applying HF's Meta->HF q/k permutation on export (needed for interleaved RoPE, not for ours) breaks logits."""
    from safetensors.torch import load_file, save_file

    saved = train_and_save(tmp_path / "run", [], steps=1)
    export_hf(saved.steps[1], tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    weights = load_file(str(path))
    cfg = saved.settings.model

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        rows, cols = w.shape
        return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    for i in range(cfg.n_layers):
        q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
        weights[q], weights[k] = permute(weights[q], cfg.n_heads), permute(weights[k], cfg.kv_heads)
    save_file(weights, str(path), metadata={"format": "pt"})
    toks = tokens()
    with torch.no_grad():
        ours = load_model(saved.steps[1])(toks)
    assert max_rel_diff(ours, hf_logits(tmp_path / "hf", toks)) > 1e-3


MOE = [
    "--model.qk_norm=true",
    "--model.moe.num_experts=4",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden_dim=16",
    "--model.moe.first_dense_layers=1",
]


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_export_loads_as_qwen3_moe_with_the_same_logits(tmp_path: Path, renormalize: bool) -> None:
    saved = train_and_save(tmp_path / "run", [*MOE, f"--model.moe.renormalize={str(renormalize).lower()}"], steps=1)
    listed = {t["name"]: t for t in summarize(open_checkpoint(saved.steps[1]))["tensors"]}
    assert listed["model.layers.1.feed_forward.experts.w1"]["shape"] == [4, 16, 32]  # inspect-ckpt shows experts
    assert "model.layers.1.feed_forward.expert_bias" in listed
    result = export_hf(saved.steps[1], tmp_path / "hf", max_shard_bytes=20_000)  # several shards
    assert len(result.files) > 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [0]
    toks = tokens()
    with torch.no_grad():
        ours = load_model(saved.steps[1])(toks)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        theirs = hf(toks).logits
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    rel = max_rel_diff(ours, theirs)
    print(f"export-hf MoE renormalize={renormalize}: max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL
    with torch.no_grad():  # and back: the Qwen3-MoE directory loads ...
        back = load_model(tmp_path / "hf")
        assert back.cfg.moe is not None and back.cfg.moe.renormalize == renormalize
        assert max_rel_diff(ours, back(toks)) <= REL_TOL
    # ... and warm-starts a training run (checkpoint.init_from), balancing switched on
    extra = [*MOE, f"--model.moe.renormalize={str(renormalize).lower()}", "--model.moe.bias_update_rate=0.001"]
    s = load_settings(overrides=[*TINY, *extra, f"--checkpoint.init_from={tmp_path / 'hf'}"], use_env=False).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    opt = build_optimizer(model, s.optimizer)
    mgr = build_checkpointer(
        s,
        runtime,
        tmp_path / "run2",
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    )
    restored = mgr.restore()
    assert restored is not None and restored.kind == "warm_start"
    with torch.no_grad():
        assert max_rel_diff(ours, model.eval()(toks)) <= REL_TOL


def test_moe_export_refuses_what_qwen3_moe_cannot_express(tmp_path: Path) -> None:
    saved = train_and_save(tmp_path / "run", [*MOE, "--model.moe.num_shared_experts=1"], steps=1)
    with pytest.raises(CheckpointError, match="num_shared_experts"):
        export_hf(saved.steps[1], tmp_path / "hf")
