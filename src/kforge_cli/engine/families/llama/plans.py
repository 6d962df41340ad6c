"""The Llama family's parallel plans, as data (applied by ``engine.parallel``).

Tensor parallelism (Megatron style, with sequence parallelism): per block, Q/K/V and the MLP's
gate/up (``w1``/``w3``) are column-parallel, the attention output ``wo`` and the MLP's down
projection ``w2`` row-parallel; attention and the MLP gather the sequence-split residual stream
first; the two norms run on the split stream; QK-norm weights act on each rank's local heads.
An MoE block splits only its shared experts (like the dense MLP, reduced to a replicated
output); the router and the routed experts run whole on every TP rank on the all-gathered
tokens (a replicated region). At the root the embedding is vocabulary-parallel (row-wise), the
head column-parallel over the vocabulary, the final norm on the split stream.
"""

from __future__ import annotations

from torch import nn

from kforge_cli.engine.families.base import HEAD, ParallelPlan, TPRule
from kforge_cli.engine.model.moe import MoEFeedForward

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
    float8_skip=(HEAD, "gate"),  # the head, and MoE routers (routing stays in high precision)
    fp32_buffers=("rope_cos", "rope_sin"),
)

_ATTENTION = (
    TPRule("attention", "gather_input", inputs=4),  # (x, cos, sin, mask): only x is the stream
    TPRule("attention.wq", "colwise"),
    TPRule("attention.wk", "colwise"),
    TPRule("attention.wv", "colwise"),
    TPRule("attention.wo", "rowwise"),
)
_DENSE_MLP = (
    TPRule("feed_forward", "gather_input"),
    TPRule("feed_forward.w1", "colwise"),
    TPRule("feed_forward.w2", "rowwise"),
    TPRule("feed_forward.w3", "colwise", optional=True),  # GELU: no up projection
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
    TPRule("attention.q_norm", "heads_norm", optional=True),
    TPRule("attention.k_norm", "heads_norm", optional=True),
)


def tp_block_plan(block: nn.Module) -> tuple[TPRule, ...]:
    """The TP rules of one block: dense or MoE feed-forward (see module docstring)."""
    moe = isinstance(block.get_submodule("feed_forward"), MoEFeedForward)
    return _ATTENTION + (_MOE if moe else _DENSE_MLP) + _NORMS
