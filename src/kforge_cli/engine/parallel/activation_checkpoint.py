"""Activation checkpointing per block (the family's ``layers``), without changing parameter names.

Each checkpointed block's ``forward`` is replaced (on the instance) by one that runs the
original inside torch's non-reentrant ``checkpoint``: no wrapper module, so checkpoint
keys stay ``layers.N....`` whatever the AC mode. Being inside ``forward``, the checkpoint
is traced by ``torch.compile`` as one region (a higher-order op) with ``fullgraph=True``;
torch's composable ``checkpoint`` (forward hooks that enter and leave a context manager)
breaks the graph there. Modes:
- full: every block recomputes its activations in backward;
- selective/block: every k-th block (train.ac_every_n_blocks) is checkpointed, counting
  global block indices (0, k, 2k, ...) so a pipeline stage agrees with the full model;
- selective/op: every block, but the outputs of matmuls and attention are saved and
  only the cheap element-wise ops are recomputed (an MoE block's grouped GEMMs count as
  matmuls; its routing, sort and scatter are recomputed). The policy matches ops by their overload
  packet (``aten.mm``, any overload): under ``torch.compile`` it sees the overloads the
  compiler traces, which need not be ``.default``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.settings.training import TrainSettings

_aten = torch.ops.aten
# Ops whose outputs are expensive to recompute, by overload packet: keep them (op-level selective AC).
SAVE_OPS = {
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
    _aten._scaled_mm,
    _aten._scaled_dot_product_attention_math,
    _aten._grouped_mm,  # the MoE experts' grouped GEMMs, plain and float8-scaled
    _aten._scaled_grouped_mm,
}


def save_decision(op: object) -> CheckpointPolicy:
    """MUST_SAVE for a matmul/attention op in any overload (``mm.default``, ``mm.out``...), else recompute."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _ignore_profiler_ops_in_selective_ac() -> None:
    """Let op-level selective AC compose with FSDP2 on the same block.

    FSDP2's pre-forward hook runs before the checkpoint region in the forward but inside
    it during the recompute, where it opens a profiler ``record_function``; selective AC
    then finds an op it never saw and aborts the backward. Profiler record-function ops
    carry no tensor data, so replaying them is always safe: they join torch's own list
    of ops that selective AC ignores.
    """
    from torch.utils import checkpoint as ckpt

    profiler = torch.ops.profiler
    ckpt.SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }
    )


def _op_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    del ctx, args, kwargs
    return save_decision(op)


def _op_policy_context() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
    return create_selective_checkpoint_contexts(_op_policy)


def checkpoint_block(
    block: nn.Module,
    context_fn: Callable[[], tuple[AbstractContextManager[object], AbstractContextManager[object]]] | None = None,
) -> None:
    """Run ``block``'s forward under non-reentrant checkpointing from now on (see module docstring)."""
    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:  # the block's own arguments and result, passed through
        if context_fn is not None:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward  # type: ignore[method-assign]


def apply_activation_checkpointing(model: nn.Module, cfg: TrainSettings) -> int:
    """Checkpoint the model's blocks per `cfg`; returns how many blocks were checkpointed."""
    if cfg.activation_checkpointing == "none":
        return 0
    layers = getattr(model, BLOCKS, None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(f"activation checkpointing expects a model with a `{BLOCKS}` ModuleDict")
    done = 0
    for key, block in layers.items():
        index = int(key)  # the global block index, so a pipeline stage picks the same blocks as the full model
        if cfg.activation_checkpointing == "full":
            checkpoint_block(block)
        elif cfg.ac_selective_mode == "op":
            _ignore_profiler_ops_in_selective_ac()
            checkpoint_block(block, context_fn=_op_policy_context)
        elif index % cfg.ac_every_n_blocks == 0:
            checkpoint_block(block)
        else:
            continue
        done += 1
    return done
