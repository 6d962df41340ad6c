"""`build_parallel_model`: the model for this rank, built on the meta device, with the
parallel plan applied in order (TP -> float8 -> AC -> compile -> FSDP2), then
materialised with `to_empty` + `init_weights` so no rank ever holds more than its shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kforge_cli.engine.model import Transformer
from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.errors import NotBuiltYetError
from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PipelineBundle:
    """Pipeline stages and schedule of this rank (pipeline parallelism only)."""

    stages: list[Any]
    schedule: Any
    is_first: bool
    is_last: bool


def compute_dtype(settings: JobSettings, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: train.mixed_precision, with auto = bf16 on CUDA, fp32 on CPU."""
    mp = settings.train.mixed_precision
    if mp == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[mp]


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (parameter names unchanged)."""
    for block in model.layers.values():  # type: ignore[union-attr]
        block.compile()


def build_parallel_model(settings: JobSettings, runtime: RuntimeContext) -> tuple[nn.Module, PipelineBundle | None]:
    """Build, parallelise and initialise the model for this rank."""
    dims = runtime.dims
    if dims.world_size > 1 or settings.train.float8:
        what = "float8" if settings.train.float8 else f"a {dims.world_size}-process mesh"
        raise NotBuiltYetError(f"training with {what} is not built yet (distributed issue); run on one process")
    with torch.device("meta"):
        model = Transformer(settings.model)
    n_ac = apply_activation_checkpointing(model, settings.train)
    if n_ac:
        log.info("activation checkpointing (%s) on %d blocks", settings.train.activation_checkpointing, n_ac)
    if settings.train.compile_model:
        apply_compile(model)
    model.to_empty(device=runtime.device)
    with torch.no_grad():
        model.init_weights(buffer_device=runtime.device)
    master = DTYPES[settings.train.master_dtype]
    if master != torch.float32:
        model.to(master)
    model.train()
    return model, None
