"""The MoE feed-forward: route, sort tokens by expert, grouped GEMM, weighted scatter back.

Per-step statistics live in non-persistent buffers of the layer and are summed over
every micro-batch of a step; :func:`kforge_cli.engine.model.moe.balancing.finish_moe_step`
all-reduces them once per optimizer step, updates the persistent ``expert_bias`` buffer
(aux-loss-free balancing) and resets them. A forward that runs inside the autograd
engine (the recompute of activation checkpointing) does not count again, so neither
AC nor gradient accumulation can double-count. The aux losses of the latest forward
are kept in ``aux_loss`` (a graph-connected scalar) for the step to add to its loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from kforge_cli.engine.model.mlp import FeedForward
from kforge_cli.engine.model.moe.dispatch import run_experts_parallel
from kforge_cli.engine.model.moe.experts import GroupedExperts
from kforge_cli.engine.model.moe.router import Routing, TopKRouter
from kforge_cli.settings.training import ModelSettings


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. the recompute of a checkpointed block).

    False while torch.compile traces: kforge compiles each block *around* its checkpoint
    (AC before compile, engine.parallel.build), so the recompute runs inside the compiled
    backward graph, which replays no Python and no buffer update; the trace is of the forward.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    """Routed experts (+ optional shared experts), a drop-in for :class:`FeedForward`.

    Names (a checkpoint contract): ``router.gate.weight`` ``[E, dim]``, ``experts.{w1,w3}``
    ``[E, hidden, dim]``, ``experts.w2`` ``[E, dim, hidden]``, ``shared_experts.{w1,w2,w3}``
    (one SwiGLU FFN of ``num_shared_experts * hidden``), buffer ``expert_bias`` ``[E]``.
    """

    expert_bias: torch.Tensor
    step_tokens: torch.Tensor
    step_dropped: torch.Tensor
    step_aux: torch.Tensor
    step_forwards: torch.Tensor

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError("MoEFeedForward needs model.moe")
        if cfg.activation != "swiglu":
            raise ValueError("MoE experts are SwiGLU; set model.activation = 'swiglu'")
        self.moe = moe
        hidden = moe.resolved_expert_hidden_dim(cfg)
        self.router = TopKRouter(cfg.dim, moe)
        self.experts = GroupedExperts(cfg.dim, hidden, moe.num_experts, moe.grouped_mm)
        self.shared_experts: FeedForward | None = None
        if moe.num_shared_experts:
            shared = cfg.model_copy(update={"ffn_hidden_dim": hidden * moe.num_shared_experts, "moe": None})
            self.shared_experts = FeedForward(shared)
        e = moe.num_experts
        self.register_buffer("expert_bias", torch.zeros(e), persistent=True)
        # Integer counters: exact at any count, and untouched by model.to(bf16).
        self.register_buffer("step_tokens", torch.zeros(e, dtype=torch.long), persistent=False)
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("step_aux", torch.zeros(()), persistent=False)
        self.register_buffer("step_forwards", torch.zeros((), dtype=torch.long), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # Set by the training step under data parallelism: the load-balance loss then uses the
        # expert load of the whole global micro-batch (all ranks), so it equals one process's.
        self.load_group: dist.ProcessGroup | None = None
        self.global_load = False
        # Set by engine.parallel.expert_parallel under distributed.ep > 1: this rank holds only its
        # experts' Shard(0) and exchanges token rows with the EP group by all-to-all.
        self.ep_group: dist.ProcessGroup | None = None

    def reset_step_stats(self) -> None:
        """Zero the per-step counters (after a step, or after loading: they are never saved)."""
        for buf in (self.step_tokens, self.step_dropped, self.step_aux, self.step_forwards):
            buf.zero_()

    def init_weights(self, std: float, out_std: float) -> None:
        """Router and expert inputs ~ N(0, std), expert outputs ~ N(0, out_std); bias and stats zero."""
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
        self.expert_bias.zero_()
        self.reset_step_stats()
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        use_bias = self.moe.bias_update_rate > 0
        routing = self.router(flat, self.expert_bias if use_bias else None)
        out = self._routed(flat, routing)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def _routed(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        n, k, e = flat.shape[0], self.moe.top_k, self.moe.num_experts
        chosen = routing.experts.reshape(-1)
        # Not bincount: its output size depends on the data, which torch.compile cannot trace.
        counts = torch.zeros(e, dtype=torch.long, device=flat.device).index_add_(0, chosen, torch.ones_like(chosen))
        order = torch.argsort(chosen, stable=True)  # by expert, then token order
        weights = routing.weights.reshape(-1)[order]
        token_ids = order // k
        dropped = torch.zeros((), dtype=torch.long, device=flat.device)
        if self.moe.capacity_factor is not None:
            capacity = math.ceil(self.moe.capacity_factor * n * k / e)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(order.numel(), device=flat.device) - starts.repeat_interleave(
                counts, output_size=order.numel()
            )
            keep = rank_in_expert < capacity
            token_ids, weights = token_ids[keep], weights[keep]
            kept = counts.clamp(max=capacity)
            dropped = (counts - kept).sum()
            expert_counts = kept
        else:
            expert_counts = counts
        if self.ep_group is not None:
            y = run_experts_parallel(flat[token_ids], expert_counts, self.experts, self.ep_group)
        else:
            y = self.experts(flat[token_ids], expert_counts)
        y = (y.float() * weights.unsqueeze(-1)).to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, token_ids, y)
        aux = self._aux_losses(routing, counts, n)
        if not in_backward():
            self.aux_loss = aux
            if self.training:
                with torch.no_grad():
                    self.step_tokens += counts
                    self.step_dropped += dropped
                    self.step_aux += aux.detach().to(self.step_aux.dtype) if aux is not None else 0.0
                    self.step_forwards += 1
        return out

    def _aux_losses(self, routing: Routing, counts: torch.Tensor, n: int) -> torch.Tensor | None:
        """Weighted load-balance loss ``E * sum_i f_i P_i`` plus router z-loss, or None when both are off.

        ``f_i`` is expert ``i``'s share of the routed token copies (of this micro-batch on
        every data-parallel rank when ``global_load`` is set), ``P_i`` its mean router
        probability over this rank's tokens; the step weights each rank's term by its tokens.
        """
        moe = self.moe
        total: torch.Tensor | None = None
        if moe.aux_loss_weight > 0:
            load = counts.float()
            if self.global_load and self.training and dist.is_initialized():
                load = load.clone()
                dist.all_reduce(load, group=self.load_group)
            frac = load / load.sum().clamp(min=1.0)
            total = moe.aux_loss_weight * moe.num_experts * (frac * routing.probs.mean(dim=0)).sum()
        if moe.z_loss_weight > 0:
            z = moe.z_loss_weight * torch.logsumexp(routing.logits, dim=-1).square().mean()
            total = z if total is None else total + z
        return total
