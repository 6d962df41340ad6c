"""Expert parallelism (``distributed.ep``): routed experts split over the ``ep`` mesh dim.

Layout (see engine.runtime.mesh): ``dp_shard = dp_shard_mod_ep x ep``. On each MoE layer

- the stacked expert weights ``experts.w{1,2,3}`` ``[E, out, in]`` become DTensors
  ``Shard(0)`` over ``ep``: EP rank ``r`` holds experts ``r*E/ep .. (r+1)*E/ep - 1`` whole;
- tokens reach their experts' rank by all-to-all (engine.model.moe.dispatch), inside the
  forward, with autograd;
- FSDP2 shards the experts further over ``dp_shard_mod_ep`` (x ``dp_replicate``: HSDP)
  as their own unit, while the rest of the block (attention, norms, router, shared
  experts) is sharded over all of ``dp_shard`` by the block's unit.

Gradients: an expert's gradient on its EP rank already sums the contributions of the
tokens of all ``ep`` ranks, so its reduction over the remaining ``dp / ep`` ranks must
still divide by the whole data-parallel degree (``set_gradient_divide_factor(dp)``), as
the block's reduction over all ``dp`` ranks does; then every update equals one process's.

Why the experts are their own FSDP unit, and why that cannot deadlock: the two
all-to-alls of a layer run inside the block's forward (and backward), between the
block's all-gather (over ``dp_shard``) and the experts' all-gather (over
``dp_shard_mod_ep``), which is issued by the experts' pre-forward hook *after* the
dispatch all-to-all. Every rank issues these collectives in the same program order
(FSDP2 prefetches in backward by the recorded forward order, the same on every rank), so
no rank can block in an all-gather that a peer will only join after an all-to-all the
first rank has not entered. Were the experts inside the block's unit, their gather
would be a ``dp_shard`` gather of a different shape (EP ranks hold different experts)
and FSDP2 could not shard them at all; with ``Shard(0)`` DTensors as their parameters,
FSDP2 composes the two shardings (its 2-D "FSDP + EP" layout) and DCP sees one global
tensor per weight, so checkpoints reshard between EP degrees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from kforge_cli.engine.model.moe import moe_layers
from kforge_cli.engine.parallel.cost_terms import Traffic
from kforge_cli.engine.parallel.fsdp import mixed_precision_policy
from kforge_cli.settings.training import ModelSettings

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh | None) -> int:
    """Split every MoE layer's routed experts ``Shard(0)`` over ``ep_mesh``; returns the layer count."""
    if ep_mesh is None:
        return 0
    n = 0
    for _, layer in moe_layers(module):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: slice locally (the weights are on meta here; init fills them later).
            shard = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        layer.ep_group = ep_mesh.get_group()
        n += 1
    return n


def shard_experts(
    module: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype, reshard_after_forward: bool, dp_size: int
) -> None:
    """``fully_shard`` each MoE layer's experts over ``mesh`` (before the blocks are sharded)."""
    policy = mixed_precision_policy(param_dtype)
    for _, layer in moe_layers(module):
        fully_shard(layer.experts, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        experts = layer.experts
        assert isinstance(experts, FSDPModule)
        experts.set_gradient_divide_factor(float(dp_size))
        if mesh.size(mesh.ndim - 1) > 1:
            # Reduce-scatter by plain sum, then divide: a custom factor is otherwise NCCL's PREMUL_SUM,
            # which gloo lacks. Only with a real reduce-scatter: over one rank torch 2.13 divides in its
            # copy path and would divide a second time after it.
            experts.set_force_sum_reduction_for_comms(True)


# Cost terms (pure, for the planner: engine.parallel.cost_terms).


def all_to_all_bytes(
    model: ModelSettings, ep: int, tokens: int, full_ac: bool, n_moe_layers: int, compute_bytes: int
) -> int:
    """Bytes one rank sends by all-to-all for ``tokens`` of its own: each MoE layer sends every routed
    copy of a token (``tokens x top_k x dim``) to its expert's rank and back (dispatch + combine),
    forward, backward and again in a fully checkpointed block's recompute; the ``(ep - 1) / ep``
    share leaves the rank (a balanced router's average). Under TP every TP rank sends it."""
    moe = model.moe
    if moe is None or ep <= 1:
        return 0
    one_way = tokens * moe.top_k * model.dim * compute_bytes * (ep - 1) // ep
    passes = 3 if full_ac else 2  # forward, backward (+ the recompute)
    return 2 * passes * one_way * n_moe_layers  # dispatch + combine in each pass


def comm_terms(
    model: ModelSettings, *, ep: int, stride: int, tokens: int, full_ac: bool, n_moe_layers: int, compute_bytes: int
) -> list[Traffic]:
    """EP's traffic of one rank per step (:func:`all_to_all_bytes`) over its EP group (ranks ``stride`` apart)."""
    sent = all_to_all_bytes(model, ep, tokens, full_ac, n_moe_layers, compute_bytes)
    return [Traffic("ep", sent, ep, stride)] if sent else []
