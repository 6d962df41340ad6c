"""How a Llama-family model's tensors and config become a Hugging Face model's: the text
:class:`Layout` (Llama, Qwen3, the MoE architectures of ``hf_moe``), which ``interop.hf_export``
and ``interop.hf_vlm`` write from through the family's HF mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kforge_cli.common.json_values import dict_of, float_of, int_of
from kforge_cli.engine.families.llama.hf_moe import (
    ERNIE_MOE,
    EXPERT_BIAS,
    EXPERT_DOWN,
    MoEArch,
    bias_in_use,
    choose_moe_arch,
    moe_config,
    to_hf_moe_name,
)
from kforge_cli.engine.families.llama.hf_names import hf_config, qwen3_config, to_hf_name, to_hf_qwen3_name
from kforge_cli.errors import CheckpointError
from kforge_cli.settings.training import ModelSettings


@dataclass(frozen=True)
class Layout:
    """How each kforge tensor of a text model becomes Hugging Face tensors (names, splits, permutations)."""

    hf_class: str
    moe: MoEArch | None
    qk_norm: bool
    n_heads: int
    kv_heads: int
    fold_scale: float  # route_scale folded into the experts' down_proj (1: none)
    use_bias: bool  # the selection bias routes (else it is written as zeros, as kforge ignores it)

    @staticmethod
    def of(fields: dict[str, object]) -> Layout:
        n_heads = int_of(fields["n_heads"])
        kv_heads = int_of(fields.get("n_kv_heads") or n_heads)
        qk_norm = bool(fields.get("qk_norm"))
        if not fields.get("moe"):
            cls = "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"
            return Layout(cls, None, qk_norm, n_heads, kv_heads, 1.0, False)
        arch, why = choose_moe_arch(fields)
        if arch is None:
            raise CheckpointError("no transformers MoE architecture holds this model: " + "; ".join(why))
        scale = float_of(dict_of(fields["moe"], "model.moe").get("route_scale", 1.0))
        fold = 1.0 if arch.scale_in_router else scale
        return Layout(arch.hf_class, arch, qk_norm, n_heads, kv_heads, fold, bias_in_use(fields))

    def name(self, key: str) -> str | None:
        """The HF name of kforge tensor `key` (``{e}`` marks per-expert names); None: not written."""
        if self.moe is not None:
            return to_hf_moe_name(key, self.moe, to_hf_name)
        return to_hf_qwen3_name(key) if self.qk_norm else to_hf_name(key)

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors kforge tensor `key` becomes (none, one, or one per expert)."""
        name = self.name(key)
        if name is None:
            return {}
        if "{e}" in name:
            if key.endswith(EXPERT_DOWN) and self.fold_scale != 1.0:
                t = t * self.fold_scale
            return {name.format(e=i): t[i].clone() for i in range(t.shape[0])}
        if key.endswith(EXPERT_BIAS):
            t = t if self.use_bias else torch.zeros_like(t)
            return {name: t.reshape(1, -1).clone() if self.moe is ERNIE_MOE else t.contiguous()}
        if (
            self.moe is not None
            and self.moe.interleaved_rope
            and key.endswith(("attention.wq.weight", "attention.wk.weight"))
        ):
            heads = self.n_heads if key.endswith("wq.weight") else self.kv_heads
            return {name: to_interleaved_rope(t, heads)}
        return {name: t.contiguous()}


def to_interleaved_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """``wq``/``wk`` rows for a RoPE rotating pairs (2i, 2i+1) instead of kforge's (i, i + head_dim/2)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def from_interleaved_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_interleaved_rope`."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


@dataclass(frozen=True)
class LlamaExport:
    """The family's :class:`~kforge_cli.engine.families.base.HFExport`: a :class:`Layout` and its config."""

    layout: Layout
    fields: dict[str, object]
    cfg: ModelSettings

    @property
    def hf_class(self) -> str:
        return self.layout.hf_class

    def name(self, key: str) -> str | None:
        return self.layout.name(key)

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layout.tensors(key, t)

    def config(self, torch_dtype: str) -> dict[str, object]:
        return text_config(self.layout, self.fields, self.cfg, torch_dtype)


def text_config(layout: Layout, fields: dict[str, object], cfg: ModelSettings, torch_dtype: str) -> dict[str, object]:
    """``config.json`` of the text architecture `layout` names."""
    config = hf_config(fields, ffn_hidden_dim=cfg.resolved_ffn_hidden_dim, torch_dtype=torch_dtype)
    if layout.moe is not None and cfg.moe is not None:
        return moe_config(layout.moe, fields, config, expert_hidden=cfg.moe.resolved_expert_hidden_dim(cfg))
    if layout.qk_norm:
        return qwen3_config(config, cfg.n_layers)
    return config
