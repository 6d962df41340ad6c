"""engine.parallel (layer 2): the parallel model build (TP, float8, AC, compile, FSDP2, PP)."""

from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing
from kforge_cli.engine.parallel.build import PipelineBundle, build_parallel_model, compute_dtype

__all__ = ["PipelineBundle", "apply_activation_checkpointing", "build_parallel_model", "compute_dtype"]
