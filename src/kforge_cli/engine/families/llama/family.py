"""The Llama family: Llama-style decoders, dense (Llama), with QK-norm (Qwen3) and MoE
(DeepSeek-style routers: Qwen3-MoE, GLM-4-MoE, ERNIE-4.5-MoE in Hugging Face terms)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from kforge_cli.engine.families.base import ActivationShapes, HFMapping, ModelFamily, ParallelPlan, TPRule
from kforge_cli.engine.families.llama.model import Transformer
from kforge_cli.engine.families.llama.plans import PLAN, tp_block_plan
from kforge_cli.engine.model.layers import rope_tables
from kforge_cli.settings.moe import active_ffn_hidden

if TYPE_CHECKING:
    from kforge_cli.settings.training import ModelSettings


class LlamaFamily(ModelFamily):
    """Llama, Qwen3 (``model.qk_norm``) and their MoE variants (``model.moe``)."""

    name: ClassVar[str] = "llama"
    plan: ClassVar[ParallelPlan] = PLAN

    @property
    def hf(self) -> HFMapping | None:  # type: ignore[override]
        from kforge_cli.engine.families.llama.hf import HF

        return HF

    def build(self, cfg: ModelSettings) -> nn.Module:
        return Transformer(cfg)

    def reset_buffers(self, model: nn.Module, device: torch.device | str) -> tuple[str, ...]:
        cfg = cast(Any, model).cfg
        model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device)
        return ("rope_cos", "rope_sin")

    def tp_block_plan(self, block: nn.Module) -> tuple[TPRule, ...]:
        return tp_block_plan(block)

    def non_embedding_params(self, cfg: ModelSettings) -> int:
        return cfg.non_embedding_params()

    def param_count(self, cfg: ModelSettings, *, active: bool = False) -> int:
        return cfg.param_count(active=active)

    def block_linear_params(self, cfg: ModelSettings) -> int:
        d, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.resolved_ffn_hidden_dim
        return 2 * d * q + 2 * d * kv + (3 if cfg.activation == "swiglu" else 2) * d * f

    def activation_shapes(self, cfg: ModelSettings, tp: int) -> ActivationShapes:
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        gated = cfg.activation == "swiglu"
        ffn = active_ffn_hidden(cfg)
        linear_weights = 2 * cfg.dim * q_dim + 2 * cfg.dim * kv_dim + (3 if gated else 2) * cfg.dim * ffn
        return ActivationShapes(
            dim=cfg.dim,
            q_dim=q_dim,
            kv_dim=kv_dim,
            n_heads=cfg.n_heads,
            ffn=ffn,
            ffn_local=active_ffn_hidden(cfg, tp),
            gated=gated,
            norm=cfg.norm,
            qk_norm=cfg.qk_norm,
            block_linear_weights=linear_weights,
        )


FAMILY = LlamaFamily()
