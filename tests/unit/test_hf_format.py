"""The Hugging Face Llama name and config mapping (no torch, no transformers needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.families.llama.hf_names import (
    export_problems,
    from_hf_name,
    hf_config,
    model_fields_from_hf,
    to_hf_name,
)
from kforge_cli.engine.interop.hf_format import hf_weight_files
from kforge_cli.rundir.checkpoints import is_hf_dir
from kforge_cli.settings.training import ModelSettings

KFORGE_NAMES = ["tok_embeddings.weight", "norm.weight", "output.weight"] + [
    f"layers.{i}.{p}"
    for i in (0, 11)
    for p in (
        "attention_norm.weight",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "ffn_norm.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    )
]


def test_names_map_to_the_llama_layout_and_back() -> None:
    assert to_hf_name("tok_embeddings.weight") == "model.embed_tokens.weight"
    assert to_hf_name("output.weight") == "lm_head.weight"
    assert to_hf_name("layers.3.attention.wq.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert to_hf_name("layers.3.feed_forward.w1.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert to_hf_name("layers.3.feed_forward.w3.weight") == "model.layers.3.mlp.up_proj.weight"
    assert to_hf_name("layers.3.feed_forward.w2.weight") == "model.layers.3.mlp.down_proj.weight"
    assert to_hf_name("layers.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    hf = [to_hf_name(n) for n in KFORGE_NAMES]
    assert len(set(hf)) == len(hf)
    assert [from_hf_name(n) for n in hf] == KFORGE_NAMES


def test_names_without_an_equivalent() -> None:
    with pytest.raises(CheckpointError, match="q_norm"):
        to_hf_name("layers.0.attention.q_norm.weight")
    assert from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def _fields(**over: object) -> dict[str, object]:
    return ModelSettings(
        dim=64,
        n_layers=3,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=100,
        rope_theta=5e5,
        norm_eps=1e-6,
        tie_embeddings=True,
        **over,
    ).model_dump()  # type: ignore[arg-type]


def test_config_round_trip_keeps_every_shaping_field() -> None:
    fields = _fields()
    cfg = hf_config(fields, ffn_hidden_dim=192, torch_dtype="bfloat16")
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 8 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5} and cfg["rope_theta"] == 5e5
    back = ModelSettings.model_validate(model_fields_from_hf(cfg))
    ours = ModelSettings.model_validate(fields)
    for f in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "resolved_ffn_hidden_dim",
        "rope_theta",
        "norm_eps",
        "tie_embeddings",
        "max_seq_len",
        "norm",
        "activation",
        "qk_norm",
    ):
        assert getattr(back, f) == getattr(ours, f), f


def test_transformers_4_style_rope_theta_is_read() -> None:
    cfg = hf_config(_fields(), ffn_hidden_dim=192, torch_dtype="float32")
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 1234.0
    assert model_fields_from_hf(cfg)["rope_theta"] == 1234.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling 'llama3'"),
        ({"head_dim": 16}, "head_dim 16"),
    ],
)
def test_hf_models_kforge_cannot_represent_are_refused(change: dict[str, object], message: str) -> None:
    cfg = hf_config(_fields(), ffn_hidden_dim=192, torch_dtype="float32") | change
    with pytest.raises(CheckpointError, match=message):
        model_fields_from_hf(cfg)


def test_export_problems_name_each_unrepresentable_feature() -> None:
    assert export_problems(_fields(), has_vlm=False) == []
    assert export_problems(_fields(qk_norm=True), has_vlm=False) == []  # Qwen3ForCausalLM holds QK-norm
    problems = export_problems(_fields(norm="layernorm", activation="gelu", qk_norm=True), has_vlm=True)
    assert len(problems) == 3
    assert any("RMSNorm" in p for p in problems) and any("SwiGLU" in p for p in problems)
    assert any("vision-language" in p for p in problems)


def test_hf_dir_detection_and_weight_files(tmp_path: Path) -> None:
    assert not is_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert not is_hf_dir(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pickle files are not loaded"):
        hf_weight_files(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert is_hf_dir(tmp_path)
    assert [p.name for p in hf_weight_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}})
    )
    assert [p.name for p in hf_weight_files(tmp_path)] == ["model-00002-of-00002.safetensors"]
