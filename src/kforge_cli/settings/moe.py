"""``[model.moe]``: sparse Mixture-of-Experts feed-forward layers (torch-free).

Absent (None) by default, so dense models are unchanged. The cross-field rules live
in :func:`moe_issues`, which ``settings.rules`` calls; every issue names the key to fix.
"""

from __future__ import annotations

from typing import Literal, Protocol

from kforge_cli.errors import ConfigIssue
from kforge_cli.settings.section import Section, field


class MoESettings(Section):
    """Routed experts (top-k of n), optional shared experts, router and load balancing."""

    num_experts: int = field(8, "Number of routed experts per MoE layer.", gt=0)
    top_k: int = field(2, "Routed experts each token is sent to.", gt=0)
    num_shared_experts: int = field(0, "Shared experts (a dense FFN every token passes through), 0..n.", ge=0)
    expert_hidden_dim: int | None = field(
        None, "Hidden size of one expert (None = the dense MLP's hidden size, model.resolved_ffn_hidden_dim).", gt=0
    )
    every_n_layers: int = field(1, "Make every k-th block (after first_dense_layers) an MoE block.", gt=0)
    first_dense_layers: int = field(0, "Keep the first d blocks dense (DeepSeek-style).", ge=0)
    score_func: Literal["softmax", "sigmoid"] = field(
        "softmax", "Router scoring, computed in fp32: softmax over experts, or per-expert sigmoid."
    )
    n_groups: int = field(1, "Group-limited routing: experts split into this many groups (1 = off).", gt=0)
    topk_groups: int = field(1, "Group-limited routing: tokens pick experts only from their best groups.", gt=0)
    renormalize: bool = field(True, "Renormalise the top-k gate weights of each token to sum to one.")
    route_scale: float = field(1.0, "Multiply the gate weights by this (DeepSeek-V3's routed_scaling_factor).", gt=0)
    bias_update_rate: float = field(
        0.0,
        "Aux-loss-free balancing: per-step update of the per-expert selection bias (0 = off; DeepSeek-V3 uses 1e-3).",
        ge=0,
    )
    aux_loss_weight: float = field(0.0, "Weight of the classic load-balance auxiliary loss (0 = off).", ge=0)
    z_loss_weight: float = field(0.0, "Weight of the router z-loss, mean(logsumexp(logits)^2) (0 = off).", ge=0)
    capacity_factor: float | None = field(
        None,
        "Expert capacity = factor * tokens * top_k / num_experts; tokens over it are dropped (None = no limit).",
        gt=0,
    )
    grouped_mm: bool = field(
        True, "Compute experts with grouped GEMM where torch supports it (false = per-expert loop)."
    )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based, global index) has an MoE feed-forward."""
        return layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.every_n_layers == 0

    def resolved_expert_hidden_dim(self, model: ModelShape) -> int:
        """The hidden size of one routed (and shared) expert actually built."""
        return self.expert_hidden_dim if self.expert_hidden_dim is not None else model.resolved_ffn_hidden_dim


class ModelShape(Protocol):
    """What these rules read of `ModelSettings` (a protocol, so this module need not import it)."""

    @property
    def dim(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def activation(self) -> str: ...

    @property
    def resolved_ffn_hidden_dim(self) -> int: ...

    @property
    def moe(self) -> MoESettings | None: ...


def moe_issues(m: ModelShape) -> list[ConfigIssue]:
    """Cross-field rules of ``model.moe``; empty when the model is dense."""
    moe = m.moe
    if moe is None:
        return []
    out: list[ConfigIssue] = []
    if moe.top_k > moe.num_experts:
        out.append(ConfigIssue("model.moe.top_k", f"{moe.top_k} exceeds model.moe.num_experts ({moe.num_experts})"))
    if moe.num_experts % moe.n_groups:
        out.append(
            ConfigIssue(
                "model.moe.n_groups", f"{moe.n_groups} does not divide model.moe.num_experts ({moe.num_experts})"
            )
        )
    elif moe.n_groups > 1:
        if moe.topk_groups > moe.n_groups:
            out.append(
                ConfigIssue("model.moe.topk_groups", f"{moe.topk_groups} exceeds model.moe.n_groups ({moe.n_groups})")
            )
        elif moe.topk_groups * (moe.num_experts // moe.n_groups) < moe.top_k:
            out.append(
                ConfigIssue(
                    "model.moe.topk_groups",
                    f"{moe.topk_groups} group(s) of {moe.num_experts // moe.n_groups} experts hold fewer than "
                    f"model.moe.top_k ({moe.top_k}) experts",
                )
            )
    if moe.first_dense_layers >= m.n_layers:
        out.append(
            ConfigIssue(
                "model.moe.first_dense_layers",
                f"{moe.first_dense_layers} leaves no MoE block in model.n_layers ({m.n_layers}); lower it or drop [model.moe]",
            )
        )
    if moe.renormalize and moe.top_k == 1 and moe.score_func == "softmax":
        out.append(
            ConfigIssue(
                "model.moe.renormalize",
                "with top_k = 1 and softmax scoring every gate weight becomes 1 and the router gets no gradient; "
                "set renormalize = false",
            )
        )
    return out


def expert_parallel_issues(m: ModelShape, ep: int, dp_shard: int) -> list[ConfigIssue]:
    """Rules of ``distributed.ep``: it needs MoE blocks, and splits both the experts and ``dp_shard``.

    ``dp_shard`` is ``distributed.dp_shard`` as set (-1 = the rest of the world: checked later,
    once the world size is known, by :func:`ep_dp_shard_issues`). Expert parallelism is carved out
    of ``dp_shard`` (``dp_shard = dp_shard_mod_ep x ep``), so the EP ranks see different batches,
    and each holds ``num_experts / ep`` whole experts.
    """
    if ep == 1:
        return []
    if m.moe is None:
        return [ConfigIssue("distributed.ep", f"{ep} needs a Mixture-of-Experts model: add [model.moe] or set ep = 1")]
    out: list[ConfigIssue] = []
    if m.moe.num_experts % ep:
        out.append(ConfigIssue("distributed.ep", f"{ep} does not divide model.moe.num_experts ({m.moe.num_experts})"))
    return out + ep_dp_shard_issues(ep, dp_shard)


def ep_dp_shard_issues(ep: int, dp_shard: int) -> list[ConfigIssue]:
    """``ep`` must divide the FSDP degree it is carved from (nothing to say while that is unknown, -1)."""
    if ep == 1 or dp_shard < 1 or dp_shard % ep == 0:
        return []
    return [
        ConfigIssue(
            "distributed.ep",
            f"{ep} does not divide distributed.dp_shard ({dp_shard}): expert-parallel ranks are carved "
            "out of the FSDP ranks (dp_shard = dp_shard_mod_ep x ep)",
        )
    ]


def ffn_params(m: ModelShape, layer: int, *, active: bool) -> int:
    """Parameters of block ``layer``'s feed-forward: all of them, or those one token uses (``active``).

    The one formula behind ``param_count`` (total) and the FLOP count (active): an MoE
    layer has the router ``E x dim``, the shared experts and ``E`` (total) or ``top_k``
    (active) routed SwiGLU experts of ``3 x dim x expert_hidden`` each.
    """
    d = m.dim
    moe = m.moe
    if moe is None or not moe.is_moe_layer(layer):
        return (3 if m.activation == "swiglu" else 2) * d * m.resolved_ffn_hidden_dim
    expert = 3 * d * moe.resolved_expert_hidden_dim(m)
    routed = moe.top_k if active else moe.num_experts
    return moe.num_experts * d + (moe.num_shared_experts + routed) * expert


def active_ffn_hidden(m: ModelShape, tp: int = 1) -> int:
    """The widest per-token feed-forward hidden size of any block on one of ``tp`` tensor-parallel ranks.

    Dense MLP: its hidden size / tp. MoE: top_k x expert hidden (the routed experts are not
    split over TP: every TP rank computes them whole) + shared x expert hidden / tp. What
    activation-memory estimates use for the MLP of a block; routing buffers are small next to it.
    """
    moe = m.moe
    if moe is None:
        return m.resolved_ffn_hidden_dim // tp
    layers = range(m.n_layers)
    hidden = moe.resolved_expert_hidden_dim(m)
    moe_hidden = moe.top_k * hidden + moe.num_shared_experts * hidden // tp
    dense = any(not moe.is_moe_layer(i) for i in layers)
    return max(moe_hidden, m.resolved_ffn_hidden_dim // tp if dense else 0)
