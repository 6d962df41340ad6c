"""The Hugging Face MoE layouts a kforge MoE model is exported to (and imported from).

Three ``transformers`` architectures between them hold every router kforge trains,
each exactly (the round-trip tests compare logits):

- ``Qwen3MoeForCausalLM``: softmax top-k router with or without renormalisation
  (``norm_topk_prob``), QK-norm attention, no shared experts, no selection bias; dense
  blocks anywhere (``mlp_only_layers``).
- ``Glm4MoeForCausalLM``: DeepSeek-V3's router on GQA attention: sigmoid scores, the
  selection-only ``e_score_correction_bias`` (kforge's ``expert_bias``), group-limited
  routing (``n_group``/``topk_group``, a group scored by its two best members),
  optional renormalisation, ``routed_scaling_factor``, ungated shared experts, optional
  QK-norm (``use_qk_norm``), dense first blocks (``first_k_dense_replace``).
- ``Ernie4_5_MoeForCausalLM``: softmax router with a selection-only bias (its
  ``moe_statics.e_score_correction_bias``), always renormalised, ungated shared experts,
  GQA attention without QK-norm, MoE every ``moe_layer_interval`` blocks. Its RoPE rotates
  *interleaved* pairs, so ``wq``/``wk`` rows are permuted within each head on export.

The first of them that holds a model is used; what none holds is refused with the fields
named. ``route_scale`` without a ``routed_scaling_factor`` (Qwen3-MoE, ERNIE) is folded
into the experts' ``down_proj``. Experts are written per expert
(``mlp.experts.<e>.{gate,up,down}_proj.weight``, the layout ``save_pretrained`` writes);
the fused ``gate_up_proj`` of earlier kforge exports is still read.
Imports no torch: the tensor transforms live in ``hf_export`` / ``hf_import``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kforge_cli.common.json_values import dict_of, float_of, int_of, list_of
from kforge_cli.errors import CheckpointError


@dataclass(frozen=True)
class MoEArch:
    model_type: str
    hf_class: str
    title: str
    bias: str | None  # where the selection bias lives under ``mlp.`` (None: no bias)
    interleaved_rope: bool = False
    scale_in_router: bool = False  # routed_scaling_factor exists (else route_scale is folded into down_proj)


QWEN3_MOE = MoEArch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", None)
GLM4_MOE = MoEArch("glm4_moe", "Glm4MoeForCausalLM", "GLM-4-MoE", "gate.e_score_correction_bias", scale_in_router=True)
ERNIE_MOE = MoEArch(
    "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "ERNIE-4.5-MoE", "moe_statics.e_score_correction_bias", True
)
MOE_ARCHES = (QWEN3_MOE, GLM4_MOE, ERNIE_MOE)
BY_MODEL_TYPE = {a.model_type: a for a in MOE_ARCHES}

ROUTER_GATE = "feed_forward.router.gate.weight"
EXPERT_BIAS = "feed_forward.expert_bias"
EXPERT_STACKS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj"}
EXPERT_DOWN = "feed_forward.experts.w2"
EXPERT_NAMES = {**EXPERT_STACKS, EXPERT_DOWN: "down_proj"}
FUSED_HF = "mlp.experts.gate_up_proj"  # earlier kforge exports (and transformers' in-memory layout)
FUSED_DOWN_HF = "mlp.experts.down_proj"
_BLOCK = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    ROUTER_GATE: "mlp.gate.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_KF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _moe(model: dict[str, object]) -> dict[str, object]:
    return dict_of(model.get("moe") or {}, "model.moe")


def bias_in_use(model: dict[str, object]) -> bool:
    """kforge routes with ``expert_bias`` only while balancing updates it (``bias_update_rate > 0``)."""
    return float_of(_moe(model).get("bias_update_rate", 0.0)) > 0


def _common_problems(moe: dict[str, object]) -> list[str]:
    if moe.get("capacity_factor") is not None:
        return ["model.moe.capacity_factor is set (it drops tokens over capacity; no transformers MoE does)"]
    return []


def _qwen3_problems(model: dict[str, object]) -> list[str]:
    moe = _moe(model)
    out = _common_problems(moe)
    if not model.get("qk_norm"):
        out.append("model.qk_norm = false (its attention always has a query/key norm)")
    if moe.get("score_func", "softmax") != "softmax":
        out.append("model.moe.score_func = 'sigmoid' (it routes with softmax)")
    if moe.get("num_shared_experts", 0):
        out.append("model.moe.num_shared_experts > 0 (no shared experts)")
    if int_of(moe.get("n_groups", 1)) != 1:
        out.append("model.moe.n_groups > 1 (no group-limited routing)")
    if bias_in_use(model):
        out.append("model.moe.bias_update_rate > 0 (no expert selection bias)")
    return out


def _glm4_problems(model: dict[str, object]) -> list[str]:
    moe = _moe(model)
    out = _common_problems(moe)
    if moe.get("score_func", "softmax") != "sigmoid":
        out.append("model.moe.score_func = 'softmax' (it routes with a sigmoid)")
    if int_of(moe.get("every_n_layers", 1)) != 1:
        out.append("model.moe.every_n_layers > 1 (every block after the dense first ones is MoE)")
    groups = int_of(moe.get("n_groups", 1))
    if groups > 1 and int_of(moe.get("num_experts", 8)) // groups < 2:
        out.append("model.moe.n_groups = num_experts (it scores a group by its two best experts)")
    return out


def _ernie_problems(model: dict[str, object]) -> list[str]:
    moe = _moe(model)
    out = _common_problems(moe)
    if moe.get("score_func", "softmax") != "softmax":
        out.append("model.moe.score_func = 'sigmoid' (it routes with softmax)")
    if model.get("qk_norm"):
        out.append("model.qk_norm = true (no query/key norm)")
    if not moe.get("renormalize", True):
        out.append("model.moe.renormalize = false (it always renormalises the top-k weights)")
    if int_of(moe.get("n_groups", 1)) != 1:
        out.append("model.moe.n_groups > 1 (no group-limited routing)")
    every, first = int_of(moe.get("every_n_layers", 1)), int_of(moe.get("first_dense_layers", 0))
    if every > 1 and (first + 1) % every:
        out.append(
            f"model.moe.every_n_layers = {every} with first_dense_layers = {first} (its MoE blocks are those "
            f"whose index + 1 is a multiple of the interval)"
        )
    return out


_PROBLEMS = {QWEN3_MOE: _qwen3_problems, GLM4_MOE: _glm4_problems, ERNIE_MOE: _ernie_problems}


def choose_moe_arch(model: dict[str, object]) -> tuple[MoEArch | None, list[str]]:
    """The first architecture holding this MoE model (``model.*`` fields without prefix), or None and why not."""
    why = []
    for arch in MOE_ARCHES:
        problems = _PROBLEMS[arch](model)
        if not problems:
            return arch, []
        why.append(f"{arch.hf_class}: " + ", ".join(problems))
    return None, why


def moe_export_problems(model: dict[str, object]) -> list[str]:
    """Empty when some architecture holds the model; else one line per architecture naming what it lacks."""
    arch, why = choose_moe_arch(model)
    return [] if arch is not None else ["no transformers MoE architecture holds this router (" + "; ".join(why) + ")"]


def is_moe_layer(moe: dict[str, object], layer: int) -> bool:
    first, every = int_of(moe.get("first_dense_layers", 0)), int_of(moe.get("every_n_layers", 1))
    return layer >= first and (layer - first) % every == 0


def to_hf_moe_name(name: str, arch: MoEArch, llama_name: Callable[[str], str | None]) -> str | None:
    """kforge name -> HF name; ``{e}`` marks a per-expert name; None: not written (a bias the arch lacks)."""
    m = _KF_LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        if rest in _BLOCK:
            return f"model.layers.{layer}.{_BLOCK[rest]}"
        if rest in EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{{e}}.{EXPERT_NAMES[rest]}.weight"
        if rest == EXPERT_BIAS:
            return None if arch.bias is None else f"model.layers.{layer}.mlp.{arch.bias}"
    return llama_name(name)


def moe_config(
    arch: MoEArch, model: dict[str, object], llama: dict[str, object], *, expert_hidden: int
) -> dict[str, object]:
    """``config.json`` of `arch`: the Llama config plus the MoE fields."""
    moe = _moe(model)
    if not moe:
        raise CheckpointError("not an MoE model")
    n_layers = int_of(model["n_layers"])
    experts, top_k = int_of(moe.get("num_experts", 8)), int_of(moe.get("top_k", 2))
    shared = int_of(moe.get("num_shared_experts", 0))
    first = int_of(moe.get("first_dense_layers", 0))
    cfg = dict(llama)
    cfg.pop("mlp_bias", None)
    cfg.update(
        {
            "architectures": [arch.hf_class],
            "model_type": arch.model_type,
            "moe_intermediate_size": int(expert_hidden),
            "num_experts_per_tok": top_k,
            "output_router_logits": False,
            "router_aux_loss_coef": float_of(moe.get("aux_loss_weight", 0.0)),
        }
    )
    if arch is QWEN3_MOE:
        cfg.update(
            {
                "num_experts": experts,
                "norm_topk_prob": bool(moe.get("renormalize", True)),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(n_layers) if not is_moe_layer(moe, i)],
                "use_sliding_window": False,
                "sliding_window": None,
            }
        )
    elif arch is GLM4_MOE:
        theta = float_of(model["rope_theta"])
        cfg.update(
            {
                "n_routed_experts": experts,
                "n_shared_experts": shared,
                "n_group": int_of(moe.get("n_groups", 1)),
                "topk_group": int_of(moe.get("topk_groups", 1)) if int_of(moe.get("n_groups", 1)) > 1 else 1,
                "norm_topk_prob": bool(moe.get("renormalize", True)),
                "routed_scaling_factor": float_of(moe.get("route_scale", 1.0)),
                "first_k_dense_replace": first,
                "use_qk_norm": bool(model.get("qk_norm")),
                "num_nextn_predict_layers": 0,
                # GLM-4.5 rotates half of each head by default; kforge rotates all of it
                "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0},
                "partial_rotary_factor": 1.0,
            }
        )
    else:
        every = int_of(moe.get("every_n_layers", 1))
        cfg.pop("attention_bias", None)
        cfg.update(
            {
                "moe_num_experts": experts,
                "moe_k": top_k,
                "moe_num_shared_experts": shared,
                "moe_layer_start_index": first,
                "moe_layer_end_index": n_layers - 1,
                "moe_layer_interval": every,
                "moe_norm_min": 1e-20,  # kforge divides by (sum + 1e-20); a softmax top-k sum is never that small
                "use_bias": False,
                "num_nextn_predict_layers": 0,
            }
        )
    return cfg


@dataclass(frozen=True)
class HFMoEName:
    """Where an HF MoE tensor goes in kforge: ``name``, and for per-expert tensors the ``expert`` index."""

    name: str
    expert: int | None = None
    fused: bool = False  # a fused ``gate_up_proj`` [E, 2 x hidden, dim]: w1 over w3


_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_EXPERT_BACK = {v: k for k, v in EXPERT_NAMES.items()}
_BIAS_BACK = {a.bias for a in MOE_ARCHES if a.bias}


def from_hf_moe_name(name: str) -> HFMoEName | None:
    """HF MoE name -> kforge name (None: not an MoE tensor)."""
    m = _HF_LAYER.match(name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    if rest in _BLOCK_BACK:
        return HFMoEName(prefix + _BLOCK_BACK[rest])
    e = _HF_EXPERT.match(rest)
    if e:
        return HFMoEName(prefix + _EXPERT_BACK[e.group(2)], int(e.group(1)))
    if rest == FUSED_HF:
        return HFMoEName(prefix + "feed_forward.experts.w1", fused=True)
    if rest == FUSED_DOWN_HF:
        return HFMoEName(prefix + EXPERT_DOWN)
    if rest.startswith("mlp.") and rest[4:] in _BIAS_BACK:
        return HFMoEName(prefix + EXPERT_BIAS)
    return None


def _refuse(problems: list[str]) -> None:
    if problems:
        raise CheckpointError("this Hugging Face model cannot be represented by kforge: " + "; ".join(problems))


def moe_fields_from_hf(
    config: dict[str, object], llama_fields: Callable[[dict[str, object]], dict[str, object]]
) -> dict[str, object]:
    """kforge ``model.*`` settings of a Qwen3-MoE, GLM-4-MoE or ERNIE-4.5-MoE config."""
    kind = config.get("model_type")
    n_layers = int_of(config.get("num_hidden_layers", 0))
    problems: list[str] = []
    if kind == "qwen3_moe":
        dense = sorted(int_of(i) for i in list_of(config.get("mlp_only_layers") or [], "mlp_only_layers"))
        step = int_of(config.get("decoder_sparse_step", 1))
        if step != 1:
            problems.append(f"decoder_sparse_step {step} (kforge expresses dense blocks as a prefix)")
        if dense != list(range(len(dense))) or len(dense) >= n_layers:
            problems.append(f"mlp_only_layers {dense} (kforge keeps only the first blocks dense)")
        _refuse(problems)
        fields = dict(llama_fields({**config, "model_type": "llama"}))
        fields["qk_norm"] = True
        fields["moe"] = {
            "num_experts": int_of(config["num_experts"]),
            "top_k": int_of(config["num_experts_per_tok"]),
            "expert_hidden_dim": int_of(config["moe_intermediate_size"]),
            "first_dense_layers": len(dense),
            "renormalize": bool(config.get("norm_topk_prob", False)),
        }
        return fields
    if kind == "glm4_moe":
        params = dict_of(config.get("rope_parameters") or {}, "rope_parameters")
        partial = float_of(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5)))
        if partial != 1.0:
            problems.append(f"partial_rotary_factor {partial} (kforge rotates every dimension of a head)")
        if config.get("attention_bias"):
            problems.append("attention_bias = true (kforge's projections have no bias)")
        groups = int_of(config.get("n_group") or 1)
        _refuse(problems)
        fields = dict(llama_fields({**config, "model_type": "llama", "attention_bias": False}))
        fields["qk_norm"] = bool(config.get("use_qk_norm", False))
        fields["moe"] = {
            "num_experts": int_of(config["n_routed_experts"]),
            "top_k": int_of(config["num_experts_per_tok"]),
            "num_shared_experts": int_of(config.get("n_shared_experts") or 0),
            "expert_hidden_dim": int_of(config["moe_intermediate_size"]),
            "first_dense_layers": int_of(config.get("first_k_dense_replace") or 0),
            "score_func": "sigmoid",
            "n_groups": groups,
            "topk_groups": int_of(config.get("topk_group") or 1) if groups > 1 else 1,
            "renormalize": bool(config.get("norm_topk_prob", True)),
            "route_scale": float_of(config.get("routed_scaling_factor") or 1.0),
            "bias_update_rate": 1e-3,  # kforge routes with the bias only while it is being balanced
        }
        return fields
    # ernie4_5_moe
    if config.get("use_bias"):
        problems.append("use_bias = true (kforge's projections have no bias)")
    norm_min = float_of(config.get("moe_norm_min", 1e-12))
    if norm_min > 1e-6:
        problems.append(f"moe_norm_min {norm_min} (kforge renormalises by the plain sum)")
    start = int_of(config.get("moe_layer_start_index", 1))
    end = config.get("moe_layer_end_index", -1)
    end = n_layers - 1 if end in (None, -1) else int_of(end)
    every = int_of(config.get("moe_layer_interval", 1))
    layers = [i for i in range(n_layers) if (i + 1) % every == 0 and start <= i <= end]
    first = layers[0] if layers else n_layers
    if layers != [i for i in range(n_layers) if i >= first and (i - first) % every == 0]:
        problems.append(f"MoE blocks {layers} (kforge's MoE blocks run every k-th block to the end)")
    _refuse(problems)
    fields = dict(llama_fields({**config, "model_type": "llama", "attention_bias": False}))
    fields["moe"] = {
        "num_experts": int_of(config.get("moe_num_experts") or config["num_experts"]),
        "top_k": int_of(config.get("moe_k") or config["num_experts_per_tok"]),
        "num_shared_experts": int_of(config.get("moe_num_shared_experts") or 0),
        "expert_hidden_dim": int_of(config["moe_intermediate_size"]),
        "first_dense_layers": first,
        "every_n_layers": every,
        "score_func": "softmax",
        "renormalize": True,
        "bias_update_rate": 1e-3,
    }
    return fields
