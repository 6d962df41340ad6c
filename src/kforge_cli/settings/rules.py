"""Validation rules beyond single fields, in two stages.

Stage 1 (`config_issues`) needs nothing but the config. Stage 2 (`world_size_issues`)
needs the world size the job will run at. Every rule adds a ConfigIssue naming the
field to change; all issues are collected and reported together.
"""

from __future__ import annotations

from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings.cp_rules import context_parallel_issues
from kforge_cli.settings.gemma3 import gemma3_issues
from kforge_cli.settings.infrastructure import MAX_WORLD_SIZE
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.mla import deepseek_v3_issues
from kforge_cli.settings.moe import ep_dp_shard_issues, expert_parallel_issues, moe_issues
from kforge_cli.settings.parallel_dims import ParallelDims
from kforge_cli.settings.pipeline_schedules import schedule_facts
from kforge_cli.settings.torch_version import torch_version

FLOAT8_TP_CPU = (
    "tensorwise float8 with distributed.tp > 1 needs NCCL: its TP styles all-gather float8 tensors, "
    "which gloo cannot; on CPU use --train.float8_recipe=rowwise (its collectives run in bf16), "
    "float8 with FSDP/PP only, or --train.float8=false"
)

FP16_SCALED_MODES = (
    "fp16 loss scaling is built and tested for one process and FSDP/HSDP (and context parallelism) only; "
    "use --train.mixed_precision=bf16 (no loss scaling needed) with pipeline or tensor parallelism"
)

FLEX_CPU = (
    "FlexAttention has no backward on CPU (torch 2.13), so it cannot train there; use "
    "--model.attention=auto (dense-mask SDPA on CPU, FlexAttention on CUDA) or sdpa"
)


MEMORY_SNAPSHOT_CPU = (
    "records the CUDA allocator's history, and train.device is cpu: set it to 0, or train on a GPU "
    "(--train.device=cuda)"
)


def config_issues(s: JobSettings) -> list[ConfigIssue]:
    """Cross-field and cross-section rules that need only the config."""
    out: list[ConfigIssue] = []
    m, t = s.model, s.train
    if s.slurm.world_size > MAX_WORLD_SIZE:
        out.append(
            ConfigIssue(
                "slurm.nodes",
                f"slurm.nodes x slurm.gpus_per_node = {s.slurm.world_size:,} processes, above kforge's maximum "
                f"world size {MAX_WORLD_SIZE:,}",
            )
        )
    if s.slurm.min_nodes is not None and s.slurm.min_nodes > s.slurm.nodes:
        out.append(
            ConfigIssue("slurm.min_nodes", f"{s.slurm.min_nodes} is above slurm.nodes ({s.slurm.nodes}): at most that")
        )
    if m.family == "deepseek_v3":
        pass  # MLA's head dimensions are set in [model.mla], not derived from model.dim
    elif m.dim % m.n_heads:
        out.append(ConfigIssue("model.dim", f"{m.dim} is not divisible by model.n_heads ({m.n_heads})"))
    elif m.head_dim % 2:
        out.append(ConfigIssue("model.dim", f"head dim dim/n_heads = {m.head_dim} must be even for RoPE"))
    if m.n_heads % m.kv_heads:
        out.append(ConfigIssue("model.n_kv_heads", f"{m.kv_heads} does not divide model.n_heads ({m.n_heads})"))
    if t.seq_len > m.max_seq_len:
        out.append(ConfigIssue("train.seq_len", f"{t.seq_len} exceeds model.max_seq_len ({m.max_seq_len})"))
    if s.data.datasets and s.data.path:
        out.append(ConfigIssue("data.datasets", "set either data.path or data.datasets, not both"))
    names = [d.name for d in s.data.datasets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        out.append(ConfigIssue("data.datasets", f"duplicate dataset names: {', '.join(dupes)}"))
    last = -1
    for i, phase in enumerate(s.data.phases):
        if phase.start_step <= last:
            out.append(
                ConfigIssue(
                    f"data.phases.{i}.start_step",
                    f"{phase.start_step} must be greater than the previous phase's ({last})",
                )
            )
        last = phase.start_step
        unknown = sorted(set(phase.dataset_weights) - set(names))
        if unknown:
            out.append(
                ConfigIssue(
                    f"data.phases.{i}.dataset_weights",
                    f"unknown dataset(s) {', '.join(unknown)}; data.datasets has: {', '.join(names) or 'none'}",
                )
            )
    if s.profiling.enabled and s.profiling.end_step < s.profiling.start_step:
        out.append(ConfigIssue("profiling.end_step", "must not be before profiling.start_step"))
    if (
        t.activation_checkpointing == "selective"
        and t.ac_selective_mode == "block"
        and t.ac_every_n_blocks > m.n_layers
    ):
        out.append(ConfigIssue("train.ac_every_n_blocks", f"exceeds model.n_layers ({m.n_layers})"))
    out += moe_issues(m) + expert_parallel_issues(m, s.distributed.ep, s.distributed.dp_shard)
    out += deepseek_v3_issues(m)
    if m.mtp_depth and s.distributed.pp > 1:
        out.append(
            ConfigIssue(
                "model.mtp_depth",
                "multi-token prediction reads the token embedding (first stage) after the last block (last stage); "
                "not supported with distributes.distributed.pp > 1: set mtp_depth = 0, or pp = 1",
            )
        )
    if m.mtp_depth and s.distributed.cp > 1:
        out.append(
            ConfigIssue(
                "model.mtp_depth",
                "multi-token prediction shifts the sequence by whole tokens across context-parallel shards; "
                "not supported with distributes.distributed.cp > 1: set mtp_depth = 0, or cp = 1",
            )
        )
    out += gemma3_issues(m, s.distributed.cp_attention, t.loss_chunk_size)
    if m.attention == "flex" and t.device == "cpu":
        out.append(ConfigIssue("model.attention", FLEX_CPU))
    if s.profiling.memory_snapshot_steps and t.device == "cpu":
        out.append(ConfigIssue("profiling.memory_snapshot_steps", MEMORY_SNAPSHOT_CPU))
    if m.moe is not None and s.distributed.cp > 1 and s.distributed.ep > 1:
        out.append(
            ConfigIssue(
                "distributed.cp",
                "context parallelism with expert parallelism (distributed.ep > 1) is not supported; "
                "use cp = 1, or ep = 1 (MoE with cp > 1 and ep = 1 works)",
            )
        )
    out += _vlm_issues(s)
    out += _resilience_issues(s)
    out += _eval_after_checkpoint_issues(s)
    return out


def _eval_after_checkpoint_issues(s: JobSettings) -> list[ConfigIssue]:
    e = s.eval
    if not e.after_checkpoint:
        return []
    out: list[ConfigIssue] = []
    if s.checkpoint.dir:
        out.append(
            ConfigIssue(
                "eval.after_checkpoint",
                "needs the checkpoints inside the run directory (an evaluation reads the run's settings and data "
                "from there): leave checkpoint.dir unset, or turn eval.after_checkpoint off",
            )
        )
    if not e.after_checkpoint_tasks:
        out.append(ConfigIssue("eval.after_checkpoint_tasks", 'is empty: name at least one task (e.g. ["heldout"])'))
    return out


def _resilience_issues(s: JobSettings) -> list[ConfigIssue]:
    r = s.resilience
    out: list[ConfigIssue] = []
    if 0 < r.straggler_ratio <= 1:
        out.append(
            ConfigIssue(
                "resilience.straggler_ratio",
                f"{r.straggler_ratio} would name a straggler in every window: use a ratio above 1 (e.g. 1.5), "
                "or 0 for no report",
            )
        )
    if r.exclude_stragglers and r.straggler_ratio == 0:
        out.append(
            ConfigIssue(
                "resilience.exclude_stragglers",
                "needs the straggler report, which resilience.straggler_ratio = 0 turns off: set straggler_ratio "
                "(e.g. 1.5) or exclude_stragglers = false",
            )
        )
    return out


def config_warnings(s: JobSettings) -> list[ConfigIssue]:
    """Settings that are allowed but probably not meant (printed as warnings, never refused)."""
    out: list[ConfigIssue] = []
    if s.scheduler.warmup_steps > s.train.max_steps:
        out.append(
            ConfigIssue(
                "scheduler.warmup_steps",
                f"{s.scheduler.warmup_steps} exceeds train.max_steps ({s.train.max_steps}): the learning rate "
                "never reaches its peak (fine for a smoke test)",
            )
        )
    if s.train.float8 and not s.train.compile_model:
        out.append(
            ConfigIssue(
                "train.float8",
                "on without train.compile_model: eager float8 runs its casts and scales as separate kernels "
                "and is usually slower than bf16; add --train.compile_model=true",
            )
        )
    if s.slurm.nodes > 1:
        for name in ("partition", "account"):
            if getattr(s.slurm, name) is None:
                out.append(
                    ConfigIssue(
                        f"slurm.{name}",
                        f"not set for {_a(s.slurm.nodes)} {s.slurm.nodes}-node job: most clusters need one "
                        f"(--slurm.{name}=NAME), else the cluster's default is used",
                    )
                )
    return out


def _vlm_issues(s: JobSettings) -> list[ConfigIssue]:
    out: list[ConfigIssue] = []
    vlm_only = [n for n in ("vision_encoder", "adapter", "video") if getattr(s, n) is not None]
    if s.vlm is None:
        out += [ConfigIssue(n, f"[{n}] is set but [vlm] is not: add a [vlm] section") for n in vlm_only]
        return out
    enc = s.vision_encoder
    if enc is None:
        out.append(ConfigIssue("vision_encoder", "a VLM needs a vision encoder: add a [vision_encoder] section"))
        return out
    if enc.type == "hf" and not enc.path:
        out.append(ConfigIssue("vision_encoder.path", "type = 'hf' needs the path of a local model directory"))
    if enc.image_size % enc.patch_size:
        out.append(
            ConfigIssue(
                "vision_encoder.image_size", f"{enc.image_size} is not divisible by patch_size {enc.patch_size}"
            )
        )
    if enc.dim % enc.n_heads:
        out.append(ConfigIssue("vision_encoder.dim", f"{enc.dim} is not divisible by n_heads {enc.n_heads}"))
    tokens = enc.tokens_per_frame
    if s.adapter is not None and s.adapter.type == "avgpool":
        side = enc.image_size // enc.patch_size
        if side % s.adapter.pool:
            out.append(ConfigIssue("adapter.pool", f"{s.adapter.pool} does not divide the {side}x{side} patch grid"))
        tokens = (side // s.adapter.pool) ** 2
    frames = s.video.max_frames if s.video is not None else 1
    if s.vlm.arch != "cross_attention":
        need = frames * tokens + s.vlm.max_text_len
        if need > s.train.seq_len:
            out.append(
                ConfigIssue(
                    "train.seq_len",
                    f"{s.train.seq_len} is too short for {frames} frame(s) x {tokens} image tokens "
                    f"+ vlm.max_text_len {s.vlm.max_text_len} = {need}",
                )
            )
    elif s.vlm.max_text_len > s.train.seq_len:
        out.append(ConfigIssue("vlm.max_text_len", f"exceeds train.seq_len ({s.train.seq_len})"))
    if s.vlm.arch == "mot" and "text" not in s.vlm.modalities:
        out.append(ConfigIssue("vlm.modalities", "a MoT model needs a 'text' modality"))
    if s.distributed.tp > 1 and s.vlm.arch == "mot":
        out.append(
            ConfigIssue(
                "distributed.tp",
                "tensor parallelism is not supported for vlm.arch = 'mot' (its per-modality blocks have no TP plan); "
                "shard with FSDP (distributed.dp_shard) instead, or use arch joint_decoder / cross_attention",
            )
        )
    elif s.distributed.tp > 1 and s.distributed.sequence_parallel:
        out.append(
            ConfigIssue(
                "distributed.sequence_parallel",
                "must be false for a VLM with distributed.tp > 1 (visual tokens join the text sequence that "
                "sequence parallelism would split)",
            )
        )
    last = -1
    for i, stage in enumerate(s.vlm.freeze_schedule):
        if stage.start_step <= last:
            out.append(ConfigIssue(f"vlm.freeze_schedule.{i}.start_step", "stages must start at increasing steps"))
        last = stage.start_step
    return out


def world_size_issues(s: JobSettings, world_size: int) -> list[ConfigIssue]:
    """Rules that depend on the number of processes the job runs with."""
    out: list[ConfigIssue] = []
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        return [ConfigIssue("slurm", f"world size {world_size} is not from 1 to {MAX_WORLD_SIZE:,} (kforge's maximum)")]
    d, m = s.distributed, s.model
    fixed = d.dp_replicate * d.tp * d.pp * d.cp * (d.dp_shard if d.dp_shard > 0 else 1)
    if d.dp_shard == -1:
        if world_size % fixed:
            out.append(
                ConfigIssue(
                    "distributed.dp_shard",
                    f"world size {world_size} is not divisible by dp_replicate*tp*pp*cp = {fixed}",
                )
            )
    elif d.dp_shard == 0:
        out.append(ConfigIssue("distributed.dp_shard", "must be -1 (the rest) or >= 1"))
    elif fixed != world_size:
        out.append(
            ConfigIssue(
                "distributed",
                f"pp*dp_replicate*dp_shard*cp*tp = {d.pp}*{d.dp_replicate}*{d.dp_shard}*{d.cp}*{d.tp} = {fixed} "
                f"but the world size is {world_size}",
            )
        )
    if d.dp_shard == -1 and world_size % fixed == 0:  # a set dp_shard was checked with the config
        out += ep_dp_shard_issues(d.ep, world_size // fixed)
    if m.n_heads % d.tp:
        out.append(ConfigIssue("distributed.tp", f"{d.tp} does not divide model.n_heads ({m.n_heads})"))
    if m.kv_heads % d.tp:
        out.append(ConfigIssue("distributed.tp", f"{d.tp} does not divide the KV heads ({m.kv_heads})"))
    if m.resolved_ffn_hidden_dim % d.tp:
        out.append(
            ConfigIssue("distributed.tp", f"{d.tp} does not divide the MLP hidden size ({m.resolved_ffn_hidden_dim})")
        )
    shared = m.moe.num_shared_experts * m.moe.resolved_expert_hidden_dim(m) if m.moe is not None else 0
    if shared % d.tp:  # tensor parallelism splits the shared experts' hidden units (the routed experts stay whole)
        out.append(
            ConfigIssue("distributed.tp", f"{d.tp} does not divide the MoE shared experts' hidden size ({shared})")
        )
    if d.tp > 1 and d.loss_parallel and m.vocab_size % d.tp:
        out.append(ConfigIssue("model.vocab_size", f"{m.vocab_size} is not divisible by distributed.tp ({d.tp})"))
    if d.tp > 1 and d.sequence_parallel and s.train.seq_len % d.tp:
        out.append(
            ConfigIssue(
                "train.seq_len", f"{s.train.seq_len} is not divisible by distributed.tp ({d.tp}) (sequence parallel)"
            )
        )
    facts = schedule_facts(d.pp_schedule)
    interleaved = facts.multi_stage
    stages = d.pp * d.pp_stages_per_rank
    if d.pp > 1:
        if interleaved and d.pp_stages_per_rank < 2:
            out.append(
                ConfigIssue("distributed.pp_stages_per_rank", f"schedule {d.pp_schedule} needs >= 2 stages per rank")
            )
        if facts.v_shaped and d.pp_stages_per_rank != 2:
            out.append(
                ConfigIssue(
                    "distributed.pp_stages_per_rank", f"schedule {d.pp_schedule} needs exactly 2 stages per rank"
                )
            )
        if not interleaved and d.pp_stages_per_rank != 1:
            out.append(
                ConfigIssue("distributed.pp_stages_per_rank", f"schedule {d.pp_schedule} runs one stage per rank")
            )
        if stages > m.n_layers:
            out.append(ConfigIssue("distributed.pp", f"{stages} pipeline stages exceed model.n_layers ({m.n_layers})"))
        if s.train.grad_accum_steps < d.pp:
            out.append(
                ConfigIssue(
                    "train.grad_accum_steps",
                    f"{s.train.grad_accum_steps} micro-batches are fewer than the {d.pp} pipeline ranks",
                )
            )
        if s.vlm is not None:
            out.append(ConfigIssue("distributed.pp", "pipeline parallelism is not supported for VLM models"))
        if s.eval.interval and s.eval.batch_size not in (None, s.train.batch_size):
            out.append(
                ConfigIssue("eval.batch_size", "must equal train.batch_size (or be unset) under pipeline parallelism")
            )
        out += _pipeline_schedule_issues(s)
    out += _combination_issues(s)
    out += context_parallel_issues(s)
    if d.tp > s.slurm.gpus_per_node and s.slurm.nodes > 1:
        out.append(
            ConfigIssue(
                "distributed.tp",
                f"{d.tp} exceeds slurm.gpus_per_node ({s.slurm.gpus_per_node}): TP must stay within a node",
            )
        )
    return out


def _pipeline_schedule_issues(s: JobSettings) -> list[ConfigIssue]:
    """What torch's pipeline schedules require of the micro-batch count and of torch, and FSDP's zero-bubble hazard."""
    out: list[ConfigIssue] = []
    d, m = s.distributed, s.train.grad_accum_steps
    stages = d.pp * d.pp_stages_per_rank
    facts = schedule_facts(d.pp_schedule)
    if d.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // d.pp)
        if m % rounds:
            out.append(
                ConfigIssue(
                    "train.grad_accum_steps",
                    f"schedule {d.pp_schedule} needs the micro-batch count ({m}) to be a multiple of "
                    f"{rounds} (its rounds of pp = {d.pp}); use a multiple of {d.pp}",
                )
            )
    have = torch_version()
    if have is not None and have < facts.min_torch:
        need = ".".join(map(str, facts.min_torch))
        out.append(
            ConfigIssue(
                "distributed.pp_schedule",
                f"schedule {d.pp_schedule} needs torch >= {need} (this is torch {have[0]}.{have[1]}, whose "
                f"version of it fails at the first step); use 1f1b or interleaved_1f1b, or torch >= {need}",
            )
        )
    if d.pp_schedule == "dualpipev" and m < stages:
        out.append(
            ConfigIssue("train.grad_accum_steps", f"schedule dualpipev needs at least {stages} micro-batches, got {m}")
        )
    if facts.zero_bubble and s.train.activation_checkpointing != "none":
        out.append(
            ConfigIssue(
                "train.activation_checkpointing",
                f"not supported with schedule {d.pp_schedule}: its split backward recomputes a checkpointed "
                "block twice, which torch's composable checkpoint cannot do; use 1f1b or interleaved_1f1b, "
                "or activation_checkpointing = 'none'",
            )
        )
    if facts.zero_bubble and d.reshard_after_forward:
        out.append(
            ConfigIssue(
                "distributed.reshard_after_forward",
                f"must not be true with schedule {d.pp_schedule}: FSDP2 resharding between its split "
                "backward passes gives wrong gradients; leave it unset (None) or false",
            )
        )
    return out


def _combination_issues(s: JobSettings) -> list[ConfigIssue]:
    """Feature combinations kforge refuses rather than train wrong."""
    out: list[ConfigIssue] = []
    d, m, t = s.distributed, s.model, s.train
    if d.pp > 1 and m.tie_embeddings:
        out.append(
            ConfigIssue(
                "model.tie_embeddings",
                "tied embeddings put the embedding (first stage) and the head (last stage) in one weight; "
                "not supported with distributed.pp > 1",
            )
        )
    if d.tp > 1 and m.tie_embeddings:
        out.append(ConfigIssue("model.tie_embeddings", "not supported with distributed.tp > 1; untie, or use tp = 1"))
    if m.family != "llama" and s.vlm is not None:
        out.append(ConfigIssue("model.family", "vision-language models compose around the llama family only"))
    if m.moe is not None and s.vlm is not None:
        out.append(ConfigIssue("model.moe", "MoE language models are not supported for VLMs yet; drop [model.moe]"))
    if d.tp > 1 and t.loss_chunk_size and not d.loss_parallel:
        out.append(
            ConfigIssue(
                "train.loss_chunk_size",
                "chunked loss is not supported with distributed.tp > 1 and loss_parallel = false; set "
                "distributed.loss_parallel = true (it keeps the logits split over the TP ranks) or the chunk size to 0",
            )
        )
    for name, value in (("distributed.pp", d.pp), ("distributed.tp", d.tp)):
        if t.mixed_precision == "fp16" and value > 1:
            out.append(ConfigIssue("train.mixed_precision", f"fp16 with {name} > 1: {FP16_SCALED_MODES}"))
    if d.tp > 1 and t.float8 and t.float8_recipe == "tensorwise" and t.device == "cpu":
        out.append(ConfigIssue("train.float8", FLOAT8_TP_CPU))
    have = torch_version()
    if t.float8 and t.float8_recipe == "rowwise" and t.device == "cpu" and have is not None and have < (2, 13):
        out.append(
            ConfigIssue(
                "train.float8_recipe",
                f"rowwise float8 on the CPU needs torch >= 2.13 (torch {have[0]}.{have[1]}'s CPU _scaled_mm takes "
                "per-tensor scales only); use tensorwise, a GPU, or torch >= 2.13",
            )
        )
    return out


def resolve_dims(s: JobSettings, world_size: int) -> ParallelDims:
    """The mesh shape for `world_size`; raises ConfigError listing every world-size problem."""
    issues = world_size_issues(s, world_size)
    if issues:
        raise ConfigError(issues, header=f"configuration does not fit world size {world_size}")
    d = s.distributed
    dp_shard = d.dp_shard if d.dp_shard > 0 else world_size // (d.dp_replicate * d.tp * d.pp * d.cp)
    return ParallelDims(pp=d.pp, dp_replicate=d.dp_replicate, dp_shard=dp_shard, tp=d.tp, cp=d.cp, ep=d.ep)


def _a(n: int) -> str:
    """The article before a number as it is spoken: "an 8-node job", "an 11-node job", "a 16-node job"."""
    digits = str(n)
    return (
        "an"
        if digits.startswith("8") or digits in ("11", "18") or (len(digits) == 5 and digits[:2] in ("11", "18"))
        else "a"
    )
