"""Activation checkpointing per Transformer block, without changing parameter names.

Uses torch's composable `checkpoint` (hooks, not a wrapper module), so checkpoint keys
stay `layers.N....` whatever the AC mode. Modes:
- full: every block recomputes its activations in backward;
- selective/block: every k-th block (train.ac_every_n_blocks) is checkpointed, counting
  global block indices (0, k, 2k, ...) so a pipeline stage agrees with the full model;
- selective/op: every block, but the outputs of matmuls and attention are saved and
  only the cheap element-wise ops are recomputed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from kforge_cli.settings.training import TrainSettings

_aten = torch.ops.aten
# Ops whose outputs are expensive to recompute: keep them (op-level selective AC).
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_mm.default,
}
_MATH_SDPA = getattr(_aten, "_scaled_dot_product_attention_math", None)
if _MATH_SDPA is not None:
    _SAVE_OPS.add(_MATH_SDPA.default)


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


def _op_policy_context() -> Any:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        del ctx, args, kwargs
        counts["ops"] += 1
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, cfg: TrainSettings) -> int:
    """Checkpoint the model's blocks per `cfg`; returns how many blocks were checkpointed."""
    if cfg.activation_checkpointing == "none":
        return 0
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError("activation checkpointing expects a model with a `layers` ModuleDict")
    done = 0
    for key, block in layers.items():
        index = int(key)  # the global block index, so a pipeline stage picks the same blocks as the full model
        if cfg.activation_checkpointing == "full":
            checkpoint(block)
        elif cfg.ac_selective_mode == "op":
            _ignore_profiler_ops_in_selective_ac()
            checkpoint(block, context_fn=_op_policy_context)
        elif index % cfg.ac_every_n_blocks == 0:
            checkpoint(block)
        else:
            continue
        done += 1
    return done
