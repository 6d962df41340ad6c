"""The DeepSeek-V3 family's Hugging Face mapping: ``DeepseekV3ForCausalLM`` both ways.

Config: kforge's ``model.*`` (``[model.mla]``, ``[model.moe]``) <-> ``config.json`` of
``model_type = "deepseek_v3"``. The router must be DeepSeek-V3's (sigmoid scores, groups,
renormalisation as set, ``routed_scaling_factor``, the selection bias); every block after
``first_k_dense_replace`` is MoE; ``n_shared_experts`` may be 0 only if transformers builds
shared experts anyway (it always does), so kforge exports need one or more. RoPE scaling
(YaRN and its softmax ``mscale``) is not implemented: a config with one is refused by name.

Weights: names map one to one (table below); routed experts are written per expert (the
layout ``save_pretrained`` writes), a fused ``gate_up_proj`` is read too. DeepSeek's own
checkpoints rotate *interleaved* pairs (``rope_interleave = true``); kforge rotates halves,
so on import the rotary rows of ``q_proj``/``q_b_proj`` (per head) and of
``kv_a_proj_with_mqa`` are permuted (even dimensions first), which changes no score; kforge
exports ``rope_interleave = false``. MTP modules have no counterpart in transformers: export
drops them with a warning, import builds them fresh (the caller warns).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kforge_cli.common.json_values import dict_of, float_of, int_of
from kforge_cli.errors import CheckpointError
from kforge_cli.settings.training import ModelSettings

log = logging.getLogger("kforge")

MODEL_TYPE = "deepseek_v3"
HF_CLASS = "DeepseekV3ForCausalLM"

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_EXPERTS = {
    "feed_forward.experts.w1": "gate_proj",
    "feed_forward.experts.w3": "up_proj",
    "feed_forward.experts.w2": "down_proj",
}
_EXPERTS_BACK = {v: k for k, v in _EXPERTS.items()}
_KF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def export_problems(model: Mapping[str, object]) -> list[str]:
    """What ``DeepseekV3ForCausalLM`` cannot hold of this ``model.*`` (empty: it holds it exactly)."""
    out: list[str] = []
    moe = model.get("moe")
    if not moe:
        out.append("no [model.moe] (DeepseekV3ForCausalLM's blocks after first_k_dense_replace are MoE)")
        return out
    moe = dict_of(moe, "model.moe")
    if moe.get("score_func", "softmax") != "sigmoid":
        out.append("model.moe.score_func = 'softmax' (it routes with a sigmoid)")
    if int_of(moe.get("every_n_layers", 1)) != 1:
        out.append("model.moe.every_n_layers > 1 (every block after the dense first ones is MoE)")
    if int_of(moe.get("num_shared_experts", 0)) < 1:
        out.append("model.moe.num_shared_experts = 0 (it always has shared experts)")
    if moe.get("capacity_factor") is not None:
        out.append("model.moe.capacity_factor is set (it drops no tokens)")
    groups, experts = int_of(moe.get("n_groups", 1)), int_of(moe.get("num_experts", 8))
    if experts // groups < 2:
        out.append("model.moe.n_groups = num_experts (it scores a group by its two best experts)")
    if model.get("norm", "rmsnorm") != "rmsnorm":
        out.append("model.norm must be rmsnorm")
    return out


def hf_config(
    model: Mapping[str, object], *, dense_hidden: int, expert_hidden: int, torch_dtype: str
) -> dict[str, object]:
    """``config.json`` of ``DeepseekV3ForCausalLM`` for this ``model.*`` (``export_problems`` empty)."""
    problems = export_problems(model)
    if problems:
        raise CheckpointError("DeepseekV3ForCausalLM cannot hold this model: " + "; ".join(problems))
    mla, moe = dict_of(model["mla"], "model.mla"), dict_of(model["moe"], "model.moe")
    groups = int_of(moe.get("n_groups", 1))
    theta = float_of(model.get("rope_theta", 10000.0))
    return {
        "architectures": [HF_CLASS],
        "model_type": MODEL_TYPE,
        "vocab_size": int_of(model["vocab_size"]),
        "hidden_size": int_of(model["dim"]),
        "intermediate_size": int(dense_hidden),
        "moe_intermediate_size": int(expert_hidden),
        "num_hidden_layers": int_of(model["n_layers"]),
        "num_attention_heads": int_of(model["n_heads"]),
        "num_key_value_heads": int_of(model["n_heads"]),
        "n_shared_experts": int_of(moe.get("num_shared_experts", 0)),
        "n_routed_experts": int_of(moe.get("num_experts", 8)),
        "routed_scaling_factor": float_of(moe.get("route_scale", 1.0)),
        "kv_lora_rank": int_of(mla.get("kv_lora_rank", 512)),
        "q_lora_rank": None if mla.get("q_lora_rank") is None else int_of(mla["q_lora_rank"]),
        "qk_rope_head_dim": int_of(mla.get("qk_rope_head_dim", 64)),
        "qk_nope_head_dim": int_of(mla.get("qk_nope_head_dim", 128)),
        "v_head_dim": int_of(mla.get("v_head_dim", 128)),
        "n_group": groups,
        "topk_group": int_of(moe.get("topk_groups", 1)) if groups > 1 else 1,
        "num_experts_per_tok": int_of(moe.get("top_k", 2)),
        "first_k_dense_replace": int_of(moe.get("first_dense_layers", 0)),
        "norm_topk_prob": bool(moe.get("renormalize", True)),
        "hidden_act": "silu",
        "max_position_embeddings": int_of(model["max_seq_len"]),
        "initializer_range": float_of(model.get("init_std", 0.02)),
        "rms_norm_eps": float_of(model.get("norm_eps", 1e-5)),
        "tie_word_embeddings": bool(model.get("tie_embeddings", False)),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_theta": theta,
        "rope_interleave": False,  # kforge rotates halves (module docstring)
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,  # MTP modules are dropped on export
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }


def to_hf_name(name: str) -> str | None:
    """kforge name -> HF name; ``{e}`` marks a per-expert stack; None: not exported (an MTP module)."""
    if name.startswith("mtp."):
        return None
    if name in _TOP:
        return _TOP[name]
    if name == "output.weight":
        return "lm_head.weight"
    m = _KF_LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        if rest in _BLOCK:
            return f"model.layers.{layer}.{_BLOCK[rest]}"
        if rest in _EXPERTS:
            return f"model.layers.{layer}.mlp.experts.{{e}}.{_EXPERTS[rest]}.weight"
    raise CheckpointError(f"no DeepseekV3ForCausalLM name for kforge tensor {name!r}")


def to_hf_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """kforge tensors -> HF tensors (experts split per expert), and the MTP names dropped."""
    out: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for name, tensor in state.items():
        hf = to_hf_name(name)
        if hf is None:
            dropped.append(name)
        elif "{e}" in hf:
            for e, expert in enumerate(tensor.unbind(0)):
                out[hf.format(e=e)] = expert.contiguous()
        elif name.endswith("feed_forward.expert_bias"):
            out[hf] = tensor.float()
        else:
            out[hf] = tensor
    return out, dropped


def model_fields_from_hf(config: Mapping[str, object]) -> dict[str, object]:
    """kforge ``model.*`` fields of a ``DeepseekV3ForCausalLM`` config (refusing what kforge cannot compute)."""
    problems: list[str] = []
    rope = dict(dict_of(config.get("rope_parameters") or config.get("rope_scaling") or {}, "rope_parameters"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        problems.append(f"rope scaling {kind!r} (kforge implements plain RoPE: no YaRN, no mscale)")
    if config.get("attention_bias"):
        problems.append("attention_bias = true (kforge's projections have no bias)")
    heads = int_of(config["num_attention_heads"])
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (kforge's MLPs are SwiGLU)")
    experts = int_of(config.get("n_routed_experts") or 0)
    if experts < 1:
        problems.append("n_routed_experts = 0 (kforge's DeepSeek-V3 blocks after the dense ones are MoE)")
    if problems:
        raise CheckpointError("this DeepseekV3 model cannot be represented by kforge: " + "; ".join(problems))
    theta = float_of(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    groups = int_of(config.get("n_group") or 1)
    n_layers = int_of(config["num_hidden_layers"])
    first = int_of(config.get("first_k_dense_replace") or 0)
    return {
        "family": "deepseek_v3",
        "dim": int_of(config["hidden_size"]),
        "n_layers": n_layers,
        "n_heads": heads,
        "vocab_size": int_of(config["vocab_size"]),
        "max_seq_len": int_of(config.get("max_position_embeddings", 4096)),
        "ffn_hidden_dim": int_of(config["intermediate_size"]),
        "rope_theta": theta,
        "norm": "rmsnorm",
        "norm_eps": float_of(config.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "init_std": float_of(config.get("initializer_range", 0.02)),
        "mla": {
            "kv_lora_rank": int_of(config["kv_lora_rank"]),
            "q_lora_rank": None if config.get("q_lora_rank") is None else int_of(config["q_lora_rank"]),
            "qk_rope_head_dim": int_of(config["qk_rope_head_dim"]),
            "qk_nope_head_dim": int_of(config["qk_nope_head_dim"]),
            "v_head_dim": int_of(config["v_head_dim"]),
        },
        "moe": {
            "num_experts": experts,
            "top_k": int_of(config["num_experts_per_tok"]),
            "num_shared_experts": int_of(config.get("n_shared_experts") or 0),
            "expert_hidden_dim": int_of(config["moe_intermediate_size"]),
            "first_dense_layers": min(first, n_layers),
            "score_func": "sigmoid",
            "n_groups": groups,
            "topk_groups": int_of(config.get("topk_group") or 1) if groups > 1 else 1,
            "renormalize": bool(config.get("norm_topk_prob", True)),
            "route_scale": float_of(config.get("routed_scaling_factor") or 1.0),
            "bias_update_rate": 1e-3,  # kforge routes with the bias only while it is being balanced
        },
    }


def _deinterleave(rows: torch.Tensor, rope: int, head: int) -> torch.Tensor:
    """Permute the last ``rope`` rows of every ``head``-row group from interleaved pairs to halves."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    view = rows.view(-1, head, *rows.shape[1:])
    lead, tail = view[:, : head - rope], view[:, head - rope :][:, order]
    return torch.cat([lead, tail], dim=1).reshape(rows.shape)


def from_hf_tensors(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, object]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF tensors -> kforge tensors (experts stacked, interleaved RoPE rows permuted), and the HF names skipped."""
    rope, nope = int_of(config["qk_rope_head_dim"]), int_of(config["qk_nope_head_dim"])
    rank = int_of(config["kv_lora_rank"])
    interleaved = bool(config.get("rope_interleave", True))
    n_layers = int_of(config["num_hidden_layers"])
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    skipped: list[str] = []
    for name, tensor in tensors.items():
        if name == "lm_head.weight":
            out["output.weight"] = tensor
            continue
        top = {v: k for k, v in _TOP.items()}.get(name)
        if top is not None:
            out[top] = tensor
            continue
        m = _HF_LAYER.match(name)
        if not m or int(m.group(1)) >= n_layers:  # e.g. DeepSeek's MTP layer 61: no transformers counterpart
            skipped.append(name)
            continue
        prefix, rest = f"layers.{m.group(1)}.", m.group(2)
        e = _HF_EXPERT.match(rest)
        if e:
            experts.setdefault(prefix + _EXPERTS_BACK[e.group(2)], {})[int(e.group(1))] = tensor
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            out[prefix + "feed_forward.experts.w1"] = gate.contiguous()
            out[prefix + "feed_forward.experts.w3"] = up.contiguous()
        elif rest == "mlp.experts.down_proj":
            out[prefix + "feed_forward.experts.w2"] = tensor
        elif rest in _BLOCK_BACK:
            key = prefix + _BLOCK_BACK[rest]
            if interleaved and rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
                tensor = _deinterleave(tensor, rope, nope + rope)
            elif interleaved and rest == "self_attn.kv_a_proj_with_mqa.weight":
                tensor = _deinterleave(tensor, rope, rank + rope)
            out[key] = tensor.float() if key.endswith("expert_bias") else tensor
        else:
            skipped.append(name)
    for key, per_expert in experts.items():
        out[key] = torch.stack([per_expert[i] for i in range(len(per_expert))])
    if "output.weight" not in out and bool(config.get("tie_word_embeddings", False)) is False:
        raise CheckpointError("the DeepseekV3 checkpoint has no lm_head.weight")
    return out, skipped


class DeepseekV3Export:
    """How a DeepSeek-V3 checkpoint's tensors and config become ``DeepseekV3ForCausalLM``'s (the
    family's ``HFExport``; ``interop.hf_export`` writes it). MTP tensors are dropped with a warning."""

    hf_class = HF_CLASS

    def __init__(self, fields: Mapping[str, object], cfg: ModelSettings) -> None:
        problems = export_problems(fields)
        if problems:
            raise CheckpointError("DeepseekV3ForCausalLM cannot hold this model: " + "; ".join(problems))
        self.fields, self.text_settings = dict(fields), cfg
        if cfg.mtp_depth:
            log.warning(
                "export-hf: the %d multi-token-prediction module(s) (mtp.*) have no counterpart in "
                "transformers' DeepseekV3ForCausalLM and are not exported",
                cfg.mtp_depth,
            )

    def name(self, key: str) -> str | None:
        return to_hf_name(key)

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        hf = to_hf_name(key)
        if hf is None:
            return {}
        if "{e}" in hf:
            return {hf.format(e=i): t[i].clone() for i in range(t.shape[0])}
        if key.endswith("feed_forward.expert_bias"):
            return {hf: t.float().contiguous()}
        return {hf: t.contiguous()}

    def config(self, torch_dtype: str) -> dict[str, object]:
        cfg = self.text_settings
        assert cfg.moe is not None
        return hf_config(
            self.fields,
            dense_hidden=cfg.resolved_ffn_hidden_dim,
            expert_hidden=cfg.moe.resolved_expert_hidden_dim(cfg),
            torch_dtype=torch_dtype,
        )

    def write_extras(self, out: object, tokenizer: object) -> None:  # nothing beyond config.json and the weights
        return None


def read_deepseek_v3_tensors(
    config: dict[str, object], files: Sequence[Path], wanted: set[str] | None, hf_dir: Path
) -> dict[str, torch.Tensor]:
    """kforge name -> CPU tensor of a ``DeepseekV3ForCausalLM`` directory's safetensors (all, or ``wanted``);
    tensors of layers past ``num_hidden_layers`` (DeepSeek's own MTP layers) are skipped with a warning."""
    from safetensors import SafetensorError, safe_open

    raw: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if not key.endswith("rotary_emb.inv_freq"):
                        raw[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    try:
        out, skipped = from_hf_tensors(raw, config)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{hf_dir}: cannot map its DeepseekV3 tensors ({exc})") from None
    n_layers = int_of(config.get("num_hidden_layers", 0))
    unknown = [k for k in skipped if not _beyond_layers(k, n_layers)]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise CheckpointError(f"{hf_dir} holds tensors a kforge model has no place for: {shown}")
    if skipped:
        log.warning(
            "%s: %d tensors of layers past num_hidden_layers (DeepSeek's MTP layers) not read", hf_dir, len(skipped)
        )
    return {k: v for k, v in out.items() if wanted is None or k in wanted}


def _beyond_layers(name: str, n_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n_layers


class DeepseekV3HF:
    """The family's ``HFMapping``: export to and import from ``DeepseekV3ForCausalLM``."""

    model_types: tuple[str, ...] = (MODEL_TYPE,)
    fresh_on_import: tuple[str, ...] = ("mtp.",)  # MTP modules: no transformers counterpart

    def export_problems(self, fields: dict[str, object]) -> list[str]:
        return export_problems(fields)

    def exporter(self, fields: dict[str, object], cfg: ModelSettings) -> DeepseekV3Export:
        return DeepseekV3Export(fields, cfg)

    def model_fields(self, config: dict[str, object]) -> dict[str, object]:
        return model_fields_from_hf(config)

    def read_tensors(
        self, config: dict[str, object], files: Sequence[Path], wanted: set[str] | None, where: Path
    ) -> dict[str, torch.Tensor]:
        return read_deepseek_v3_tensors(config, files, wanted, where)


HF = DeepseekV3HF()
