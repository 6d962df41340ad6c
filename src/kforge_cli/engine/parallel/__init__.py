"""engine.parallel (layer 2): the parallel model build (TP, float8, CP, AC, compile, FSDP2, PP)."""

from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing
from kforge_cli.engine.parallel.build import build_parallel_model, compute_dtype, parallelize
from kforge_cli.engine.parallel.context_parallel import shard_batch
from kforge_cli.engine.parallel.float8 import fsdp_float8_all_gather, precompute_scales_after_each_step
from kforge_cli.engine.parallel.grad_norm import clip_grad_norm, total_grad_norm
from kforge_cli.engine.parallel.pipeline import PipelineBundle, PipelineModel, StageLoss, training_step_infers_metadata
from kforge_cli.engine.parallel.tensor_parallel import vocab_parallel_loss_sum

__all__ = [
    "PipelineBundle",
    "PipelineModel",
    "StageLoss",
    "apply_activation_checkpointing",
    "build_parallel_model",
    "clip_grad_norm",
    "compute_dtype",
    "fsdp_float8_all_gather",
    "parallelize",
    "precompute_scales_after_each_step",
    "shard_batch",
    "total_grad_norm",
    "training_step_infers_metadata",
    "vocab_parallel_loss_sum",
]
