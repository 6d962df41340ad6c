"""The DeepSeek-V3 family: its builder, plans, FLOPs and shapes behind the ``ModelFamily`` interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from kforge_cli.engine.families.base import HEAD, ActivationShapes, HFMapping, ModelFamily, ParallelPlan, TPRule
from kforge_cli.engine.families.deepseek_v3.model import DeepseekV3Transformer
from kforge_cli.engine.model.layers import rope_tables
from kforge_cli.engine.model.moe import MoEFeedForward
from kforge_cli.settings.moe import active_ffn_hidden

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
    expert_parallel=True,
    float8_skip=(HEAD, "gate"),
    fp32_buffers=("rope_cos", "rope_sin"),
)

# MLA under TP: the query and key/value up-projections column-parallel by heads, the latent
# down-projections (wq_a, wkv_a) and their norms replicated, the output row-parallel. The rotary
# key is shared by all heads: MLAttention.key_grad_group sums its gradient over the TP ranks.
_MLA = (
    TPRule("attention", "gather_input", inputs=4),
    TPRule("attention.wq", "colwise", optional=True),
    TPRule("attention.wq_b", "colwise", optional=True),
    TPRule("attention.wkv_b", "colwise"),
    TPRule("attention.wo", "rowwise"),
)
_DENSE_MLP = (
    TPRule("feed_forward", "gather_input"),
    TPRule("feed_forward.w1", "colwise"),
    TPRule("feed_forward.w2", "rowwise"),
    TPRule("feed_forward.w3", "colwise", optional=True),
)
_MOE = (
    TPRule("feed_forward", "replicated_region"),
    TPRule("feed_forward.shared_experts", "replicated_input", optional=True),
    TPRule("feed_forward.shared_experts.w1", "colwise", optional=True),
    TPRule("feed_forward.shared_experts.w2", "rowwise_replicated", optional=True),
    TPRule("feed_forward.shared_experts.w3", "colwise", optional=True),
)
_NORMS = (
    TPRule("attention_norm", "sequence_norm", sp_only=True),
    TPRule("ffn_norm", "sequence_norm", sp_only=True),
)


class DeepseekV3Family(ModelFamily):
    """DeepSeek-V3: MLA attention, kforge's MoE (sigmoid groups, bias, shared experts, dense first blocks), MTP."""

    name: ClassVar[str] = "deepseek_v3"
    plan: ClassVar[ParallelPlan] = PLAN

    @property
    def hf(self) -> HFMapping | None:  # type: ignore[override]
        from kforge_cli.engine.families.deepseek_v3.hf import HF

        return HF

    def build(self, cfg: ModelSettings) -> nn.Module:
        return DeepseekV3Transformer(cfg)

    def reset_buffers(self, model: nn.Module, device: torch.device | str) -> tuple[str, ...]:
        cfg = cast(Any, model).cfg
        model.rope_cos, model.rope_sin = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, device)
        return ("rope_cos", "rope_sin")

    def param_count(self, cfg: ModelSettings, *, active: bool = False) -> int:
        return cfg.param_count(active=active)

    def block_linear_params(self, cfg: ModelSettings) -> int:
        assert cfg.mla is not None
        d = cfg.dim
        mla = cfg.mla.attention_params(d, cfg.n_heads) - cfg.mla.kv_lora_rank - (cfg.mla.q_lora_rank or 0)
        return mla + 3 * d * cfg.resolved_ffn_hidden_dim

    def extra_blocks(self, model: nn.Module) -> list[nn.Module]:
        mtp = getattr(model, "mtp", None)
        return [] if mtp is None else [module.block for module in mtp.values()]

    def tp_extra_rules(self, model: nn.Module) -> tuple[TPRule, ...]:
        """Each MTP module's norms and ``eh_proj`` act per position: sequence-split under SP."""
        mtp = getattr(model, "mtp", None)
        if mtp is None:
            return ()
        names = ("enorm", "hnorm", "eh_proj", "norm")
        return tuple(TPRule(f"mtp.{k}.{n}", "sequence_local", sp_only=True) for k in mtp for n in names)

    def tp_block_plan(self, block: nn.Module) -> tuple[TPRule, ...]:
        moe = isinstance(block.get_submodule("feed_forward"), MoEFeedForward)
        return _MLA + (_MOE if moe else _DENSE_MLP) + _NORMS

    def non_embedding_params(self, cfg: ModelSettings) -> int:
        return cfg.non_embedding_params()

    def flops_per_token(self, cfg: ModelSettings, seq_len: int) -> float:
        """``6 N`` plus attention's ``6 L T H (qk + v)`` (scores and the weighted values, forward and
        backward, causal halved) with MLA's head dimensions, MTP blocks counted as blocks."""
        mla = cfg.mla
        assert mla is not None
        layers = cfg.n_layers + cfg.mtp_depth
        attention = 6 * layers * seq_len * cfg.n_heads * (mla.qk_head_dim + mla.v_head_dim)
        return 6.0 * self.non_embedding_params(cfg) + attention

    def activation_shapes(self, cfg: ModelSettings, tp: int) -> ActivationShapes:
        mla = cfg.mla
        assert mla is not None
        q_dim = cfg.n_heads * mla.qk_head_dim
        kv_dim = cfg.n_heads * max(mla.qk_head_dim, mla.v_head_dim)
        ffn = active_ffn_hidden(cfg)
        attention = mla.attention_params(cfg.dim, cfg.n_heads)
        return ActivationShapes(
            dim=cfg.dim,
            q_dim=q_dim,
            kv_dim=kv_dim,
            n_heads=cfg.n_heads,
            ffn=ffn,
            ffn_local=active_ffn_hidden(cfg, tp),
            gated=True,
            norm=cfg.norm,
            qk_norm=False,
            block_linear_weights=attention + 3 * cfg.dim * ffn,
        )


FAMILY = DeepseekV3Family()
