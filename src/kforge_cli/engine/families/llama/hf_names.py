"""The Llama family's Hugging Face names and ``config.json`` <-> its model settings.

A dense model with QK-norm is written as ``Qwen3ForCausalLM`` (Llama plus a per-head
RMSNorm on queries and keys before RoPE, exactly kforge's ``qk_norm``); MoE models are
mapped in ``hf_moe``.

No q/k permutation is needed in either direction. Meta's original Llama checkpoints
rotate *interleaved* pairs of each head's dimensions, which is why Hugging Face's
converter permutes ``wq``/``wk``; kforge's RoPE already uses HF's ``rotate_half``
convention (dimension ``i`` paired with ``i + head_dim/2``, see
``engine.model.layers``), so its ``wq``/``wk`` are HF's ``q_proj``/``k_proj``
unchanged. The round-trip tests compare logits against ``transformers`` to hold this.
Imports no torch.
"""

from __future__ import annotations

import re

from kforge_cli.common.json_values import dict_of, float_of, int_of
from kforge_cli.errors import CheckpointError

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
QK_NORM = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_QK_NORM_BACK = {v: k for k, v in QK_NORM.items()}
_KF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf_name(name: str) -> str:
    """kforge parameter name -> Hugging Face Llama name (``layers.0.attention.wq.weight`` -> ``model.layers.0...``)."""
    if name in _TOP:
        return _TOP[name]
    m = _KF_LAYER.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise CheckpointError(f"parameter {name!r} has no Hugging Face Llama equivalent")


def to_hf_qwen3_name(name: str) -> str:
    """kforge name -> ``Qwen3ForCausalLM`` name: Llama's plus the query/key norms."""
    m = _KF_LAYER.match(name)
    if m and m.group(2) in QK_NORM:
        return f"model.layers.{m.group(1)}.{QK_NORM[m.group(2)]}"
    return to_hf_name(name)


def from_hf_name(name: str) -> str | None:
    """Hugging Face Llama (or Qwen3) name -> kforge name; None for entries kforge does not keep (e.g. rotary buffers)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"layers.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"
    if m and m.group(2) in _QK_NORM_BACK:
        return f"layers.{m.group(1)}.{_QK_NORM_BACK[m.group(2)]}"
    return None


def export_problems(model: dict[str, object], has_vlm: bool = False) -> list[str]:
    """What in a kforge text model config no ``transformers`` architecture kforge writes can hold (empty: exportable).

    Dense: ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with QK-norm); MoE: see ``hf_moe``.
    A vision-language model is checked by ``hf_vlm`` (its decoder by this function).
    """
    problems = []
    if has_vlm:
        problems.append("it is a vision-language / MoT model; only text models export to LlamaForCausalLM")
    if model.get("norm") != "rmsnorm":
        problems.append(f"model.norm = {model.get('norm')!r}: Llama, Qwen3 and the MoE architectures use RMSNorm")
    if model.get("activation") != "swiglu":
        problems.append(f"model.activation = {model.get('activation')!r}: they all use a SwiGLU MLP")
    if model.get("moe"):
        from kforge_cli.engine.families.llama.hf_moe import moe_export_problems

        return problems + moe_export_problems(model)
    return problems


def hf_config(model: dict[str, object], *, ffn_hidden_dim: int, torch_dtype: str) -> dict[str, object]:
    """``config.json`` of ``LlamaForCausalLM`` for a kforge model config (``model.*`` fields without prefix).

    RoPE theta is written both the transformers 4 way (``rope_theta``) and the 5 way
    (``rope_parameters``) so either version reads it.
    """
    n_heads = int_of(model["n_heads"])
    theta = float_of(model["rope_theta"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int_of(model["vocab_size"]),
        "hidden_size": int_of(model["dim"]),
        "intermediate_size": int(ffn_hidden_dim),
        "num_hidden_layers": int_of(model["n_layers"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int_of(model.get("n_kv_heads") or n_heads),
        "head_dim": int_of(model["dim"]) // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": int_of(model["max_seq_len"]),
        "rms_norm_eps": float_of(model["norm_eps"]),
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": bool(model.get("tie_embeddings")),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": float_of(model.get("init_std", 0.02)),
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }


def qwen3_config(llama: dict[str, object], n_layers: int) -> dict[str, object]:
    """``config.json`` of ``Qwen3ForCausalLM`` (a dense model with QK-norm) from the Llama one."""
    cfg = {k: v for k, v in llama.items() if k != "mlp_bias"}
    cfg.update(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": n_layers,
            "layer_types": ["full_attention"] * n_layers,
        }
    )
    return cfg


def _rope_theta(config: dict[str, object], problems: list[str]) -> float:
    params = dict_of(config.get("rope_parameters") or {}, "rope_parameters")
    scaling = dict_of(config.get("rope_scaling") or {}, "rope_scaling")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        problems.append(f"RoPE scaling {kind!r} (kforge implements plain RoPE)")
    return float_of(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def model_fields_from_hf(config: dict[str, object]) -> dict[str, object]:
    """kforge ``model.*`` settings equivalent to a Hugging Face Llama config; refuses what kforge lacks."""
    from kforge_cli.engine.families.llama.hf_moe import BY_MODEL_TYPE, moe_fields_from_hf

    kind = config.get("model_type")
    if kind in BY_MODEL_TYPE:
        return moe_fields_from_hf(config, model_fields_from_hf)
    if kind == "qwen3":
        if config.get("use_sliding_window"):
            raise CheckpointError("this Hugging Face model cannot be represented by kforge: use_sliding_window = true")
        return {**model_fields_from_hf({**config, "model_type": "llama"}), "qk_norm": True}
    problems: list[str] = []
    if kind != "llama":
        supported = ", ".join(repr(k) for k in ("llama", "qwen3", *BY_MODEL_TYPE))
        problems.append(f"model_type {kind!r} (supported: {supported})")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act {act!r} (kforge's SwiGLU uses silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            problems.append(f"{flag} = true (kforge's projections have no bias)")
    theta = _rope_theta(config, problems)
    try:
        dim, n_heads = int_of(config["hidden_size"]), int_of(config["num_attention_heads"])
        fields = {
            "dim": dim,
            "n_layers": int_of(config["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int_of(config.get("num_key_value_heads") or n_heads),
            "vocab_size": int_of(config["vocab_size"]),
            "ffn_hidden_dim": int_of(config["intermediate_size"]),
            "max_seq_len": int_of(config.get("max_position_embeddings") or 2048),
            "rope_theta": theta,
            "norm": "rmsnorm",
            "norm_eps": float_of(config.get("rms_norm_eps", 1e-6)),
            "activation": "swiglu",
            "qk_norm": False,
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"Hugging Face config lacks or mangles {exc} (a Llama config.json is expected)") from None
    head_dim = config.get("head_dim")
    if head_dim is not None and int_of(head_dim) != dim // n_heads:
        problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads = {dim // n_heads}")
    if problems:
        raise CheckpointError("this Hugging Face model cannot be represented by kforge: " + "; ".join(problems))
    return fields
