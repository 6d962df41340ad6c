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

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.settings import JobSettings


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


def apply_fsdp(model: nn.Module, mesh: Any, *, param_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """``fully_shard`` each block of ``model`` (a family's model or pipeline stage), then the root."""
    policy = mixed_precision_policy(param_dtype)
    blocks = list(cast(nn.ModuleDict, model.get_submodule(BLOCKS)).values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by the backward: keep them.
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
