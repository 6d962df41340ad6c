"""The Hugging Face Qwen3-MoE layout for kforge MoE checkpoints (export, and import for warm starts).

``Qwen3MoeForCausalLM`` (transformers 5) matches a kforge MoE model whose options it
can express: QK-norm attention, a softmax top-k router with optional renormalisation
(``norm_topk_prob``), no shared experts, no group-limited routing, no gate scaling, no
selection bias and no capacity limit; dense blocks are listed in ``mlp_only_layers``.
Its experts are fused: ``gate_up_proj`` ``[E, 2 x hidden, dim]`` is kforge's ``w1``
(gate) stacked over ``w3`` (up), and ``down_proj`` ``[E, dim, hidden]`` is ``w2``.
Imports no torch.
"""

from __future__ import annotations

import re
from typing import Any

from kforge_cli.engine.checkpoint.errors import CheckpointError

_KF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MOE_BLOCK = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
}
ROUTER_GATE = "feed_forward.router.gate.weight"
FUSED_GATE = "feed_forward.experts.w1"
FUSED_UP = "feed_forward.experts.w3"
FUSED_HF = "mlp.experts.gate_up_proj"
SKIPPED = "feed_forward.expert_bias"  # must be all zeros (refused otherwise): Qwen3-MoE has no selection bias


def moe_export_problems(model: dict[str, Any]) -> list[str]:
    """What Qwen3-MoE cannot express of a kforge MoE config (``model.*`` fields without prefix)."""
    moe = model.get("moe") or {}
    problems = []
    if not model.get("qk_norm"):
        problems.append("model.qk_norm = false: Qwen3-MoE attention always has a query/key norm")
    if model.get("norm") != "rmsnorm":
        problems.append(f"model.norm = {model.get('norm')!r}: Qwen3-MoE uses RMSNorm")
    if moe.get("num_shared_experts", 0):
        problems.append("model.moe.num_shared_experts > 0: Qwen3-MoE has no shared experts")
    if moe.get("score_func", "softmax") != "softmax":
        problems.append("model.moe.score_func = 'sigmoid': Qwen3-MoE routes with softmax")
    if moe.get("n_groups", 1) != 1:
        problems.append("model.moe.n_groups > 1: Qwen3-MoE has no group-limited routing")
    if float(moe.get("route_scale", 1.0)) != 1.0:
        problems.append("model.moe.route_scale != 1: Qwen3-MoE does not scale gate weights")
    if float(moe.get("bias_update_rate", 0.0)) > 0:
        problems.append("model.moe.bias_update_rate > 0: Qwen3-MoE has no expert selection bias")
    if moe.get("capacity_factor") is not None:
        problems.append("model.moe.capacity_factor is set: Qwen3-MoE never drops tokens")
    return problems


def is_moe_layer(moe: dict[str, Any], layer: int) -> bool:
    first, every = int(moe.get("first_dense_layers", 0)), int(moe.get("every_n_layers", 1))
    return layer >= first and (layer - first) % every == 0


def to_hf_moe_name(name: str, llama_name: Any) -> str | None:
    """kforge name -> Qwen3-MoE name; None for the fused pair's up half and the (zero) bias."""
    m = _KF_LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        if rest in _MOE_BLOCK:
            return f"model.layers.{layer}.{_MOE_BLOCK[rest]}"
        if rest == FUSED_GATE:
            return f"model.layers.{layer}.{FUSED_HF}"
        if rest in (FUSED_UP, SKIPPED):
            return None
    return llama_name(name)


def qwen3_moe_config(model: dict[str, Any], llama: dict[str, Any], *, expert_hidden: int) -> dict[str, Any]:
    """``config.json`` of ``Qwen3MoeForCausalLM``: the Llama config plus the MoE fields."""
    moe = model.get("moe") or {}
    n_layers = int(model["n_layers"])
    if not moe:
        raise CheckpointError("not an MoE model")
    cfg = dict(llama)
    cfg.update(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": int(expert_hidden),
            "num_experts": int(moe.get("num_experts", 8)),
            "num_experts_per_tok": int(moe.get("top_k", 2)),
            "norm_topk_prob": bool(moe.get("renormalize", True)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(n_layers) if not is_moe_layer(moe, i)],
            "output_router_logits": False,
            "router_aux_loss_coef": float(moe.get("aux_loss_weight", 0.0)),
            "use_sliding_window": False,
            "sliding_window": None,
        }
    )
    cfg.pop("mlp_bias", None)
    return cfg


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MOE_BLOCK_BACK = {v: k for k, v in _MOE_BLOCK.items()}


def from_hf_moe_name(name: str) -> str | None:
    """Qwen3-MoE name -> kforge name (``gate_up_proj`` -> the ``w1`` name; the caller splits off ``w3``)."""
    m = _HF_LAYER.match(name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    if rest == FUSED_HF:
        return f"layers.{layer}.{FUSED_GATE}"
    if rest in _MOE_BLOCK_BACK:
        return f"layers.{layer}.{_MOE_BLOCK_BACK[rest]}"
    return None


def moe_fields_from_hf(config: dict[str, Any], llama_fields: Any) -> dict[str, Any]:
    """kforge ``model.*`` settings of a Qwen3-MoE config (dense blocks must be a prefix of the stack)."""
    n_layers = int(config.get("num_hidden_layers", 0))
    dense = sorted(int(i) for i in config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    problems = []
    if step != 1:
        problems.append(f"decoder_sparse_step {step} (kforge expresses dense blocks as a prefix)")
    if dense != list(range(len(dense))) or len(dense) >= n_layers:
        problems.append(f"mlp_only_layers {dense} (kforge keeps only the first blocks dense)")
    if problems:
        raise CheckpointError("this Hugging Face model cannot be represented by kforge: " + "; ".join(problems))
    fields = dict(llama_fields({**config, "model_type": "llama"}))
    fields["qk_norm"] = True
    fields["moe"] = {
        "num_experts": int(config["num_experts"]),
        "top_k": int(config["num_experts_per_tok"]),
        "expert_hidden_dim": int(config["moe_intermediate_size"]),
        "first_dense_layers": len(dense),
        "renormalize": bool(config.get("norm_topk_prob", False)),
    }
    return fields
