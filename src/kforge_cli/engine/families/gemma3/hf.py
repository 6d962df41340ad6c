"""The Gemma 3 family's Hugging Face mapping: export to ``Gemma3ForCausalLM``; import from it and
from ``Gemma3ForConditionalGeneration`` (its language model; the vision tower and projector are
skipped: kforge's gemma3 family is text only)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kforge_cli.common.json_values import float_of, int_of, list_of
from kforge_cli.engine.families.base import HFExport
from kforge_cli.errors import CheckpointError
from kforge_cli.settings.gemma3 import Gemma3Settings
from kforge_cli.settings.training import ModelSettings

_BLOCK = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "post_ffn_norm": "post_feedforward_layernorm",
}
_ROOT = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_ROOT_BACK = {v: k for k, v in _ROOT.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight")
# Where a Gemma3ForConditionalGeneration keeps its language model (transformers 5 / 4 layouts).
_LM_PREFIXES = ("model.language_model.", "language_model.model.")
_SKIPPED_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")
_TEXT_DEFAULTS: dict[str, object] = {  # Gemma3TextConfig's defaults (a multimodal config.json may omit them)
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}


def to_hf_name(key: str) -> str | None:
    if key in _ROOT:
        return _ROOT[key]
    if key == "output.weight":
        return "lm_head.weight"
    m = _LAYER.fullmatch(key)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.weight"
    return None


def from_hf_name(name: str) -> str | None:
    """kforge name of an HF tensor name; ``""``: a tensor kforge skips (vision); None: unknown."""
    if name.startswith(_SKIPPED_PREFIXES):
        return ""
    for prefix in _LM_PREFIXES:
        if name.startswith(prefix):
            name = "model." + name.removeprefix(prefix)
    if name in _ROOT_BACK:
        return _ROOT_BACK[name]
    if name == "lm_head.weight":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"layers.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}.weight"
    return None


def layer_types(g: Gemma3Settings, n_layers: int) -> list[str]:
    return ["full_attention" if g.is_global(i) else "sliding_attention" for i in range(n_layers)]


@dataclass(frozen=True)
class Gemma3Export:
    cfg: ModelSettings

    @property
    def hf_class(self) -> str:
        return "Gemma3ForCausalLM"

    def name(self, key: str) -> str | None:
        return to_hf_name(key)

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        name = self.name(key)
        return {} if name is None else {name: t.contiguous()}

    def config(self, torch_dtype: str) -> dict[str, object]:
        c = self.cfg
        g = c.gemma3 if c.gemma3 is not None else Gemma3Settings()
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": c.vocab_size,
            "hidden_size": c.dim,
            "intermediate_size": c.resolved_ffn_hidden_dim,
            "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": c.max_seq_len,
            "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": c.tie_embeddings,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta}
                if g.rope_linear_factor == 1.0
                else {"rope_type": "linear", "rope_theta": c.rope_theta, "factor": g.rope_linear_factor},
                "sliding_attention": {"rope_type": "default", "rope_theta": g.rope_local_theta},
            },
            "attention_bias": False,
            "attention_dropout": 0.0,
            "query_pre_attn_scalar": g.query_pre_attn_scalar or c.head_dim,
            "sliding_window": g.sliding_window or c.max_seq_len,
            "layer_types": layer_types(g, c.n_layers),
            "final_logit_softcapping": g.final_logit_softcapping,
            "attn_logit_softcapping": None,
            "initializer_range": c.init_std,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }


def _text_config(config: dict[str, object]) -> dict[str, object]:
    text = config.get("text_config") if config.get("model_type") == "gemma3" else config
    if not isinstance(text, dict):
        text = {}
    return {**_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None or k.endswith("softcapping")}}


def _global_every(types: list[object]) -> int | None:
    """The ``model.gemma3.global_every`` of transformers' ``layer_types`` (None: all global)."""
    if all(t == "full_attention" for t in types):
        return None
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    n = full[0] + 1 if full else len(types) + 1
    expected = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(types))]
    if types != expected:
        raise CheckpointError(f"layer_types {types} is not every n-th layer global (model.gemma3.global_every)")
    return n


def _rope(text: dict[str, object], kind: str, legacy: str, default: float) -> tuple[float, float]:
    """(theta, linear factor) of one layer kind; the local layers take no scaling, the global ones linear."""
    params = text.get("rope_parameters") or {}
    one = params.get(kind) if isinstance(params, dict) else None
    scaling = text.get("rope_scaling")
    if not isinstance(one, dict) and kind == "full_attention" and isinstance(scaling, dict):
        one = {"rope_theta": text.get(legacy, default), **scaling}  # the transformers 4 layout
    theta, factor = float_of(text.get(legacy, default)), 1.0
    if isinstance(one, dict):
        kind_of = one.get("rope_type", one.get("type", "default"))
        if kind_of == "linear" and kind == "full_attention":
            factor = float(one["factor"])
        elif kind_of != "default":
            raise CheckpointError(f"rope scaling {kind_of!r} of the {kind} layers (kforge has linear, global layers)")
        theta = float(one.get("rope_theta", theta))
    return theta, factor


class Gemma3HF:
    """Export to ``Gemma3ForCausalLM``; import from it and ``Gemma3ForConditionalGeneration``."""

    model_types: tuple[str, ...] = ("gemma3_text", "gemma3")

    def export_problems(self, fields: dict[str, object]) -> list[str]:
        del fields
        return []

    def exporter(self, fields: dict[str, object], cfg: ModelSettings) -> HFExport:
        del fields
        return Gemma3Export(cfg)

    def model_fields(self, config: dict[str, object]) -> dict[str, object]:
        text = _text_config(config)
        problems = []
        if text.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            problems.append(f"hidden_activation {text.get('hidden_activation')!r} (kforge's GeGLU uses gelu tanh)")
        if text.get("attn_logit_softcapping") is not None:
            problems.append("attn_logit_softcapping (kforge's Gemma 3 attention has no soft-capping)")
        if text.get("attention_bias"):
            problems.append("attention_bias = true (kforge's projections have no bias)")
        if text.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention = true (kforge trains causal models)")
        if problems:
            raise CheckpointError("this Hugging Face model cannot be represented by kforge: " + "; ".join(problems))
        n_layers = int_of(text["num_hidden_layers"])
        types = list_of(
            text.get("layer_types")
            or [
                "full_attention"
                if (i + 1) % int_of(text.get("sliding_window_pattern", 6)) == 0
                else "sliding_attention"
                for i in range(n_layers)
            ],
            "layer_types",
        )
        every = _global_every(list(types))
        dim, n_heads, head_dim = (
            int_of(text["hidden_size"]),
            int_of(text["num_attention_heads"]),
            int_of(text["head_dim"]),
        )
        gemma3 = {
            "head_dim": head_dim,
            "sliding_window": None if every is None else int_of(text["sliding_window"]),
            "global_every": every or 6,
            "rope_local_theta": _rope(text, "sliding_attention", "rope_local_base_freq", 10_000.0)[0],
            "rope_linear_factor": _rope(text, "full_attention", "rope_theta", 1_000_000.0)[1],
            "query_pre_attn_scalar": int_of(text["query_pre_attn_scalar"]),
            "final_logit_softcapping": text.get("final_logit_softcapping"),
        }
        return {
            "family": "gemma3",
            "dim": dim,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": int_of(text.get("num_key_value_heads") or n_heads),
            "vocab_size": int_of(text["vocab_size"]),
            "ffn_hidden_dim": int_of(text["intermediate_size"]),
            "max_seq_len": int_of(text["max_position_embeddings"]),
            "rope_theta": _rope(text, "full_attention", "rope_theta", 1_000_000.0)[0],
            "norm": "rmsnorm",
            "norm_eps": float_of(text["rms_norm_eps"]),
            "activation": "gelu",
            "qk_norm": True,
            "tie_embeddings": bool(text.get("tie_word_embeddings", True)),
            "gemma3": gemma3,
        }

    def read_tensors(
        self, config: dict[str, object], files: Sequence[Path], wanted: set[str] | None, where: Path
    ) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        del config
        out: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for path in files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                        name = from_hf_name(key)
                        if name is None:
                            unknown.append(key)
                        elif name and (wanted is None or name in wanted):
                            out[name] = f.get_tensor(key)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {path}: {exc}") from None
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
            raise CheckpointError(f"{where} holds tensors a kforge model has no place for: {shown}")
        return out


HF = Gemma3HF()
