"""The GPT-2 family: what a family writes to get FSDP, TP (+SP), activation checkpointing,
pipeline stages, ``--plan`` and MFU from kforge (docs/extending.md walks through it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import nn

from kforge_cli.engine.families.base import HEAD, ActivationShapes, ModelFamily, ParallelPlan, TPRule
from kforge_cli.engine.families.gpt2.model import GPT2
from kforge_cli.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from kforge_cli.settings.training import ModelSettings

PLAN = ParallelPlan(
    first_stage=("wte", "wpe"),
    last_stage=("norm", HEAD),
    tp_root=(
        TPRule("wte", "vocab_embedding", optional=True),
        TPRule("wpe", "position_embedding", sp_only=True, optional=True),
        TPRule("norm", "sequence_norm", sp_only=True, optional=True),
        TPRule(HEAD, "vocab_head", optional=True),
    ),
    cp_hook=None,  # no context parallelism: learned positions and its attention take no sequence shard
    expert_parallel=False,
)

BLOCK_TP = (
    TPRule("attn", "gather_input", inputs=2),  # (x, mask)
    TPRule("attn.q_proj", "colwise"),
    TPRule("attn.k_proj", "colwise"),
    TPRule("attn.v_proj", "colwise"),
    TPRule("attn.out_proj", "rowwise"),
    TPRule("mlp", "gather_input"),
    TPRule("mlp.fc", "colwise"),
    TPRule("mlp.proj", "rowwise"),
    TPRule("ln_1", "sequence_norm", sp_only=True),
    TPRule("ln_2", "sequence_norm", sp_only=True),
)


class GPT2Family(ModelFamily):
    """``model.family = "gpt2"``: reads ``dim``, ``n_layers``, ``n_heads``, ``vocab_size``,
    ``max_seq_len``, ``ffn_hidden_dim`` (default 4 x dim), ``norm_eps``, ``tie_embeddings``,
    ``init_std``; asks for ``norm = "layernorm"`` and ``activation = "gelu"`` and refuses the
    Llama-only fields."""

    name: ClassVar[str] = "gpt2"
    plan: ClassVar[ParallelPlan] = PLAN

    def check(self, cfg: ModelSettings) -> list[ConfigIssue]:
        issues = []
        if cfg.norm != "layernorm":
            issues.append(ConfigIssue("model.norm", "the gpt2 family uses LayerNorm: set model.norm = 'layernorm'"))
        if cfg.activation != "gelu":
            issues.append(
                ConfigIssue("model.activation", "the gpt2 family uses a GELU MLP: set model.activation = 'gelu'")
            )
        if cfg.kv_heads != cfg.n_heads:
            issues.append(ConfigIssue("model.n_kv_heads", "the gpt2 family has no grouped-query attention"))
        if cfg.qk_norm:
            issues.append(ConfigIssue("model.qk_norm", "the gpt2 family has no QK-norm"))
        if cfg.moe is not None:
            issues.append(ConfigIssue("model.moe", "the gpt2 family has no MoE layers"))
        return issues

    def build(self, cfg: ModelSettings) -> nn.Module:
        issues = self.check(cfg)
        if issues:
            raise ConfigError(issues, header="settings the gpt2 model family cannot build")
        return GPT2(cfg)

    def tp_block_plan(self, block: nn.Module) -> tuple[TPRule, ...]:
        del block
        return BLOCK_TP

    def _block_params(self, cfg: ModelSettings) -> int:
        d, f = cfg.dim, cfg.resolved_ffn_hidden_dim
        return 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # attention, MLP, two LayerNorms

    def non_embedding_params(self, cfg: ModelSettings) -> int:
        """Blocks, final norm and the head (once, tied or not); not the token or position tables."""
        return cfg.n_layers * self._block_params(cfg) + 2 * cfg.dim + cfg.vocab_size * cfg.dim

    def param_count(self, cfg: ModelSettings, *, active: bool = False) -> int:
        del active  # dense: every parameter is active
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
        tables = (cfg.vocab_size + cfg.max_seq_len) * cfg.dim
        return tables + cfg.n_layers * self._block_params(cfg) + 2 * cfg.dim + head

    def block_linear_params(self, cfg: ModelSettings) -> int:
        return 4 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.resolved_ffn_hidden_dim

    def activation_shapes(self, cfg: ModelSettings, tp: int) -> ActivationShapes:
        f = cfg.resolved_ffn_hidden_dim
        return ActivationShapes(
            dim=cfg.dim,
            q_dim=cfg.dim,
            kv_dim=cfg.dim,
            n_heads=cfg.n_heads,
            ffn=f,
            ffn_local=f // tp,
            gated=False,
            norm="layernorm",
            qk_norm=False,
            block_linear_weights=self.block_linear_params(cfg),
        )


FAMILY = GPT2Family()
