"""FSDP2 (``fully_shard``) per block (the family's ``layers``) and at the root, with mixed precision.

Every parameter is sharded over the data-parallel mesh (HSDP when it is 2-D: sharded
within ``dp_shard``, replicated across ``dp_replicate``). Each block is its own
all-gather unit, so at most one or two blocks are ever unsharded; the root unit holds
the embedding, final norm and head. The sharded parameters stay in the master dtype
(fp32 by default): FSDP2 casts the gathered copy to the compute dtype (bf16 on GPU)
and reduces gradients in fp32.

Gradient reduction averages over the data-parallel ranks (FSDP2's default divide
factor, the dp size); the step functions scale the loss by dp_size / global valid
tokens so the update equals the one of a single process on the global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.engine.parallel.cost_terms import FP32, Traffic, ring_share
from kforge_cli.settings import JobSettings

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def mixed_precision_policy(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Compute in ``param_dtype`` (the train's compute dtype), reduce gradients in fp32."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def resolve_reshard_after_forward(settings: JobSettings) -> bool:
    """distributed.reshard_after_forward, where None = yes, except under pipeline parallelism.

    With PP a stage runs the forward of several micro-batches before their backward;
    freeing the gathered parameters after each would all-gather them again per
    micro-batch. Zero-bubble schedules *require* False (their split weight-gradient
    pass gives wrong gradients with resharded parameters; the rules refuse True there).
    """
    d = settings.distributed
    if d.reshard_after_forward is not None:
        return d.reshard_after_forward
    return d.pp == 1


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh | None, *, param_dtype: torch.dtype, reshard_after_forward: bool
) -> None:
    """``fully_shard`` each block of ``model`` (a family's model or pipeline stage), then the root."""
    policy = mixed_precision_policy(param_dtype)
    blocks = list(cast(nn.ModuleDict, model.get_submodule(BLOCKS)).values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by the backward: keep them.
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


# Cost terms (pure, for the planner: engine.parallel.cost_terms).


def comm_terms(
    *,
    dense_numel: int,
    expert_numel: int,
    dp_shard: int,
    dp_replicate: int,
    cp: int,
    tp: int,
    ep: int,
    micro_batches: int,
    reshard_after_forward: bool,
    compute_bytes: int,
) -> list[Traffic]:
    """FSDP2's traffic of one rank per step: all-gathers of the TP-local parameters in the compute
    dtype (twice per micro-batch with ``reshard_after_forward``: forward and backward, else once),
    one fp32 reduce-scatter of the gradients per step, and under HSDP an fp32 all-reduce of the
    gradient shards over ``dp_replicate``. Dense parameters are sharded over ``dp_shard x cp``,
    routed experts under EP over ``dp_shard / ep``."""
    gathers = micro_batches * (2 if reshard_after_forward else 1)
    inner = cp * tp
    out: list[Traffic] = []
    for numel, f, stride in ((dense_numel, dp_shard * cp, tp), (expert_numel, dp_shard // ep, ep * inner)):
        if numel and f > 1:
            out.append(Traffic("fsdp", (gathers * compute_bytes + FP32) * numel * ring_share(f), f, stride))
        if numel and dp_replicate > 1:
            r = dp_replicate
            out.append(Traffic("fsdp", 2 * numel / max(f, 1) * FP32 * ring_share(r), r, dp_shard * inner))
    return out


def buffer_bytes(
    root_numel: int,
    block_numels: list[int],
    *,
    compute_bytes: int,
    reshard_after_forward: bool,
    float8_all_gather: bool,
) -> tuple[int, int]:
    """(all-gathered parameters, unsharded gradients) at the peak of the backward, from the TP-local
    sizes of the root unit and of each block's unit (engine.plan.costs.fsdp_buffers explains)."""
    blocks = block_numels or [0]
    block_bytes = 1 if float8_all_gather else compute_bytes  # float8 linears are all-gathered in float8
    gathered = root_numel * compute_bytes + (2 * max(blocks) if reshard_after_forward else sum(blocks)) * block_bytes
    reduce_bytes = compute_bytes + (FP32 if compute_bytes < FP32 else 0)
    return gathered, root_numel * compute_bytes + max(blocks) * reduce_bytes
