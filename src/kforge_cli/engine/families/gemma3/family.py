"""The Gemma 3 family (text): its plans as data, FLOPs and shapes for the planner, its HF mapping."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

from kforge_cli.engine.families.base import HEAD, ActivationShapes, HFMapping, ModelFamily, ParallelPlan, TPRule
from kforge_cli.engine.families.gemma3.model import Gemma3Transformer
from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings.gemma3 import gemma3_issues

if TYPE_CHECKING:
    from kforge_cli.settings.training import ModelSettings

PLAN = ParallelPlan(
    first_stage=("tok_embeddings",),
    last_stage=("norm", HEAD),
    tp_root=(
        TPRule("tok_embeddings", "vocab_embedding", optional=True),
        TPRule("norm", "sequence_norm", sp_only=True, optional=True),
        TPRule(HEAD, "vocab_head", optional=True),
    ),
    cp_hook="sequence_shard",
    expert_parallel=False,
    float8_skip=(HEAD,),
    fp32_buffers=("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"),
)

# Megatron-style TP with SP: Q/K/V and the MLP's gate/up column-parallel, the outputs row-parallel
# (reduced or reduce-scattered to the stream's layout), the four block norms on the sequence-split
# stream (the post-norms with a plain local output: it is added to the residual stream), QK-norm per
# local head.
BLOCK_TP = (
    TPRule("attention", "gather_input", inputs=4),  # (x, cos, sin, mask): only x is the stream
    TPRule("attention.wq", "colwise"),
    TPRule("attention.wk", "colwise"),
    TPRule("attention.wv", "colwise"),
    TPRule("attention.wo", "rowwise"),
    TPRule("attention.q_norm", "heads_norm"),
    TPRule("attention.k_norm", "heads_norm"),
    TPRule("feed_forward", "gather_input"),
    TPRule("feed_forward.w1", "colwise"),
    TPRule("feed_forward.w3", "colwise"),
    TPRule("feed_forward.w2", "rowwise"),
    TPRule("attention_norm", "sequence_norm", sp_only=True),
    TPRule("post_attention_norm", "sequence_local", sp_only=True),
    TPRule("ffn_norm", "sequence_norm", sp_only=True),
    TPRule("post_ffn_norm", "sequence_local", sp_only=True),
)


class Gemma3Family(ModelFamily):
    """``model.family = "gemma3"``: reads the Llama shape fields and ``[model.gemma3]``."""

    name: ClassVar[str] = "gemma3"
    plan: ClassVar[ParallelPlan] = PLAN

    @property
    def hf(self) -> HFMapping | None:  # type: ignore[override]
        from kforge_cli.engine.families.gemma3.hf import HF

        return HF

    def check(self, cfg: ModelSettings) -> list[ConfigIssue]:
        return gemma3_issues(cfg, "allgather")

    def build(self, cfg: ModelSettings) -> nn.Module:
        issues = self.check(cfg)
        if issues:
            raise ConfigError(issues, header="settings the gemma3 model family cannot build")
        return Gemma3Transformer(cfg)

    def reset_buffers(self, model: nn.Module, device: torch.device | str) -> tuple[str, ...]:
        tables = cast(Gemma3Transformer, model).rope_buffers(device)
        for name, table in tables.items():
            setattr(model, name, table)
        return tuple(tables)

    def tp_block_plan(self, block: nn.Module) -> tuple[TPRule, ...]:
        del block
        return BLOCK_TP

    def _block_params(self, cfg: ModelSettings) -> int:
        d, hd = cfg.dim, cfg.head_dim
        return self.block_linear_params(cfg) + 2 * hd + 4 * d

    def non_embedding_params(self, cfg: ModelSettings) -> int:
        """Blocks, the final norm and the head (once, tied or not)."""
        return cfg.n_layers * self._block_params(cfg) + cfg.dim + cfg.vocab_size * cfg.dim

    def param_count(self, cfg: ModelSettings, *, active: bool = False) -> int:
        del active  # dense
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
        return cfg.vocab_size * cfg.dim + cfg.n_layers * self._block_params(cfg) + cfg.dim + head

    def block_linear_params(self, cfg: ModelSettings) -> int:
        d, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.resolved_ffn_hidden_dim
        return 2 * d * q + 2 * d * kv + 3 * d * f

    def activation_shapes(self, cfg: ModelSettings, tp: int) -> ActivationShapes:
        f = cfg.resolved_ffn_hidden_dim
        return ActivationShapes(
            dim=cfg.dim,
            q_dim=cfg.n_heads * cfg.head_dim,
            kv_dim=cfg.kv_heads * cfg.head_dim,
            n_heads=cfg.n_heads,
            ffn=f,
            ffn_local=f // tp,
            gated=True,
            norm="rmsnorm",
            qk_norm=True,
            block_linear_weights=self.block_linear_params(cfg),
        )


FAMILY = Gemma3Family()
