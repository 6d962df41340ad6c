"""`build_parallel_model`: this rank's model, built on the meta device and parallelised in order

    float8 (module swap) -> tensor parallel (+SP) -> expert parallel -> context parallel
    -> activation checkpointing -> torch.compile per block -> FSDP2 per block and at the root,

then materialised with ``to_empty`` and initialised shard by shard (engine.parallel.init),
so no rank ever holds more than its shard and every rank, whatever the layout, starts
from the weights a single process would have. float8 comes first because it replaces
``nn.Linear`` objects, which would drop TP hooks registered on the old ones. With
pipeline parallelism the same steps run on each stage module of this rank, and the
stages are wrapped in a schedule (`PipelineBundle`).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.engine.families.registry import family_for, family_of
from kforge_cli.engine.model.moe import MoEFeedForward
from kforge_cli.engine.model.vlm import build_vlm
from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing
from kforge_cli.engine.parallel.context_parallel import apply_context_parallel
from kforge_cli.engine.parallel.expert_parallel import apply_expert_parallel, shard_experts
from kforge_cli.engine.parallel.float8 import apply_float8, fsdp_float8_all_gather, require_torchao
from kforge_cli.engine.parallel.fsdp import apply_fsdp, mixed_precision_policy, resolve_reshard_after_forward
from kforge_cli.engine.parallel.init import init_sharded
from kforge_cli.engine.parallel.pipeline import (
    PipelineBundle,
    PipelineModel,
    build_pipeline,
    build_stage_module,
    stage_ids_of_rank,
    stage_layer_ids,
)
from kforge_cli.engine.parallel.tensor_parallel import apply_tensor_parallel
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.runtime.dtypes import DTYPES
from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings import JobSettings
from kforge_cli.settings.rules import FLEX_CPU, FLOAT8_TP_CPU

log = logging.getLogger("kforge")


def compute_dtype(settings: JobSettings, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: train.mixed_precision, with auto = bf16 on CUDA, fp32 on CPU."""
    mp = settings.train.mixed_precision
    if mp == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[mp]


def apply_compile(model: nn.Module, *, fullgraph: bool = True, backend: str = "inductor") -> None:
    """torch.compile each block in place (parameter names unchanged).

    ``fullgraph=True``: a graph break is an error at the first step (and in the tests), not
    a silent split of every block into eager fragments. A model with MoE blocks first gets
    the dynamo settings that let its routing trace in one graph (:func:`allow_moe_tracing`).
    ``backend``: tests pass ``aot_eager_decomp_partition`` (the same tracing and AC partition
    as Inductor, without its C++ code generation, which takes most of a CPU compile).
    """
    if any(isinstance(m, MoEFeedForward) for m in model.modules()):
        allow_moe_tracing()
    layers = model.get_submodule(BLOCKS)
    for block in layers.children():
        block.compile(fullgraph=fullgraph, backend=backend)


def allow_moe_tracing() -> None:
    """Process-wide dynamo settings under which an MoE block traces in one graph (torchtitan sets the first too).

    - ``capture_scalar_outputs``: the per-expert row counts (``counts.tolist()``, in the
      per-expert loop and the EP all-to-all's split sizes) become unbacked symbolic sizes
      instead of graph breaks;
    - ``capture_dynamic_output_shape_ops``: capacity dropping selects rows by a boolean mask;
    - ``skip_fwd_side_effects_in_bwd_under_checkpoint``: under activation checkpointing the
      layer's per-step counters and ``aux_loss`` are forward side effects inside the checkpoint;
      dynamo refuses them unless told not to replay them in the recompute, which is exactly
      what eager kforge does (``moe.layer.in_backward``), so AC cannot double-count.
    """
    cfg = torch._dynamo.config
    cfg.capture_scalar_outputs = True
    cfg.capture_dynamic_output_shape_ops = True
    cfg.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def cast_keeping_rope_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)``, except the family's ``plan.fp32_buffers`` (RoPE tables): they stay fp32 (long
    positions' angles need it), as on the sharded path, where ``init_sharded`` computes them in fp32 after the cast."""
    keep = family_of(model).plan.fp32_buffers
    rope = {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in keep}
    model.to(dtype)
    for name, table in rope.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, table)


def check_family_supports(settings: JobSettings, runtime: RuntimeContext) -> None:
    """Refuse a parallelism the model's family has no plan for (exit 2 naming the setting)."""
    family = family_for(settings.model)
    issues = []
    if runtime.dims.cp > 1 and family.plan.cp_hook is None:
        issues.append(ConfigIssue("distributed.cp", f"model family {family.name!r} has no context-parallel plan"))
    if runtime.dims.ep > 1 and not family.plan.expert_parallel:
        issues.append(ConfigIssue("distributed.ep", f"model family {family.name!r} has no experts to split"))
    if issues:
        raise ConfigError(issues, header=f"unsupported by model family {family.name!r}")


def parallelize(module: nn.Module, settings: JobSettings, runtime: RuntimeContext) -> None:
    """Apply float8 -> TP -> CP -> AC -> compile -> FSDP2 to one meta-device module (model or stage)."""
    t, d = settings.train, settings.distributed
    check_family_supports(settings, runtime)
    distributed = runtime.world_size > 1
    if t.float8:
        fp8_gather = fsdp_float8_all_gather(t, runtime)
        apply_float8(module, recipe=t.float8_recipe, fsdp_float8_all_gather=fp8_gather, tp=runtime.dims.tp)
    master = DTYPES[t.master_dtype]
    if distributed and master != torch.float32:
        module.to(master)  # FSDP2 keeps the sharded parameters in this dtype; init_sharded casts fp32 draws into it
    tp_mesh = runtime.tp_mesh()
    if tp_mesh is not None:
        apply_tensor_parallel(
            module,
            tp_mesh,
            sequence_parallel=d.sequence_parallel,
            loss_parallel_on=d.loss_parallel,
            float8_recipe=t.float8_recipe if t.float8 else None,
        )
    if apply_expert_parallel(module, runtime.ep_mesh()):
        log.info("expert parallel: routed experts split over ep = %d ranks", runtime.dims.ep)
    if apply_context_parallel(module, runtime, ring=d.cp_attention == "ring"):
        log.info("context parallel: cp rank %d of %d", runtime.cp_rank, runtime.cp_size)
    n_ac = apply_activation_checkpointing(module, t)
    if n_ac:
        log.info("activation checkpointing (%s) on %d blocks", t.activation_checkpointing, n_ac)
    if t.compile_model:
        fullgraph = True
        if settings.vlm is not None:  # VLM blocks are not known to trace in one graph yet
            fullgraph = False
            log.info("torch.compile of VLM blocks without fullgraph: graph breaks fall back to eager")
        elif distributed and runtime.ep_mesh() is not None:
            # The routed experts are FSDP units of their own (shard_experts): FSDP2's hooks around
            # them are a graph break by design, so the block compiles as the graphs either side.
            fullgraph = False
            log.info("torch.compile of MoE blocks under expert parallelism: one graph break at the experts' FSDP hooks")
        elif settings.model.moe is not None and (runtime.dims.pp > 1 or runtime.dims.tp > 1):
            # pp: the aux-loss gradient hook (engine.train.features.moe_aux) runs outside the graph by design;
            # tp: the MoE TP plan's layout changes around the routed experts are not traced in one graph yet.
            fullgraph = False
            log.info("torch.compile of MoE blocks under pp/tp without fullgraph: graph breaks fall back to eager")
        apply_compile(module, fullgraph=fullgraph)
    if distributed:
        for block in getattr(module, "vision_blocks", list)():  # a VLM's encoder blocks are FSDP units too
            policy = mixed_precision_policy(compute_dtype(settings, runtime.device))
            fully_shard(
                block,
                mesh=runtime.fsdp_mesh(),
                mp_policy=policy,
                reshard_after_forward=resolve_reshard_after_forward(settings),
            )
        if runtime.ep_mesh() is not None:  # the experts first: their own FSDP units (see expert_parallel)
            expert_mesh = runtime.expert_fsdp_mesh()
            assert expert_mesh is not None  # distributed with ep > 1: there is a mesh
            shard_experts(
                module,
                expert_mesh,
                param_dtype=compute_dtype(settings, runtime.device),
                reshard_after_forward=resolve_reshard_after_forward(settings),
                dp_size=runtime.dp_size,
            )
        apply_fsdp(
            module,
            runtime.fsdp_mesh(),
            param_dtype=compute_dtype(settings, runtime.device),
            reshard_after_forward=resolve_reshard_after_forward(settings),
        )


def _build_single(settings: JobSettings, runtime: RuntimeContext) -> nn.Module:
    with torch.device("meta"):
        model = build_vlm(settings) if settings.vlm is not None else family_for(settings.model).build(settings.model)
    parallelize(model, settings, runtime)
    if runtime.world_size == 1:
        master = DTYPES[settings.train.master_dtype]
        model.to_empty(device=runtime.device)
        with torch.no_grad():
            cast(Any, model).init_weights(buffer_device=runtime.device)  # in fp32 order; cast like init_sharded does
        if master != torch.float32:
            cast_keeping_rope_fp32(model, master)
    else:
        shadow = None
        if settings.vlm is not None:  # the sharded init replays the VLM's own init order
            with torch.device("meta"):
                shadow = build_vlm(settings)
        init_sharded([model], settings.model, runtime.device, shadow=shadow)
    return model


def _build_pipeline(settings: JobSettings, runtime: RuntimeContext) -> tuple[nn.Module, PipelineBundle]:
    d = settings.distributed
    n_stages = d.pp * d.pp_stages_per_rank
    layers = stage_layer_ids(settings.model.n_layers, n_stages)
    ids = stage_ids_of_rank(runtime.pp_rank, d.pp, d.pp_stages_per_rank, d.pp_schedule)
    modules: list[nn.Module] = []
    for sid in ids:
        stage = build_stage_module(settings.model, layers[sid], first=sid == 0, last=sid == n_stages - 1)
        parallelize(stage, settings, runtime)
        modules.append(stage)
    init_sharded(modules, settings.model, runtime.device)
    for m in modules:
        m.train()
    bundle = build_pipeline(settings, modules, ids, runtime.device, runtime.pp_group())
    log.info("pipeline rank %d runs stages %s (blocks %s)", runtime.pp_rank, ids, [layers[s] for s in ids])
    return PipelineModel(modules), bundle


def build_parallel_model(settings: JobSettings, runtime: RuntimeContext) -> tuple[nn.Module, PipelineBundle | None]:
    """Build, parallelise and initialise the model for this rank; the bundle is None without PP."""
    if settings.train.float8:
        require_torchao()
    tensorwise = settings.train.float8 and settings.train.float8_recipe == "tensorwise"
    if runtime.dims.tp > 1 and runtime.device.type == "cpu" and tensorwise:  # train.device=auto resolved to cpu
        raise ConfigError([ConfigIssue("train.float8", FLOAT8_TP_CPU)], header="unsupported combination on CPU")
    if settings.model.attention == "flex" and runtime.device.type == "cpu":  # train.device=auto resolved to cpu
        raise ConfigError([ConfigIssue("model.attention", FLEX_CPU)], header="unsupported combination on CPU")
    if settings.train.loss_chunk_size and runtime.dims.tp > 1:
        log.info("train.loss_chunk_size is not used under TP: the vocab-parallel loss keeps logits split instead")
    if runtime.dims.pp > 1:
        model, bundle = _build_pipeline(settings, runtime)
        model.train()
        return model, bundle
    model = _build_single(settings, runtime)
    model.train()
    return model, None
