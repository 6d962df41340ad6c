"""The Hugging Face Qwen3-MoE layout for kforge MoE checkpoints (export only).

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
