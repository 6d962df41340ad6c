"""Sections for running a job: parallelism, checkpoints, metrics, profiling, resilience, SLURM."""

from __future__ import annotations

from typing import Literal

from kforge_cli.settings.pipeline_schedules import PipelineSchedule
from kforge_cli.settings.section import Section, field

MAX_WORLD_SIZE = 1 << 20  # processes: far above any cluster; the layout search and the rules enumerate divisors
MAX_TIMEOUT_S = 30 * 24 * 3600  # 30 days: a timeout beyond it is no timeout (and overflows timedelta near 1e14)
MAX_HANG_TIMEOUT_S = 7 * 24 * 3600  # 7 days without a step is a hang on any job


class DistributedSettings(Section):
    """Parallelism over the device mesh pp x dp_replicate x dp_shard x cp x tp (dp_shard = dp_shard_mod_ep x ep)."""

    dp_shard: int = field(-1, "FSDP shard degree (-1 = whatever remains of the world size).", ge=-1)
    dp_replicate: int = field(1, "Replicate degree (> 1 with dp_shard > 1 means HSDP).", gt=0)
    tp: int = field(1, "Tensor-parallel degree (keep within one node).", gt=0)
    pp: int = field(1, "Pipeline-parallel degree (number of pipeline ranks).", gt=0)
    cp: int = field(
        1, "Context-parallel degree: each sequence is split over this many ranks (train.seq_len % (2*cp) == 0).", gt=0
    )
    cp_attention: Literal["allgather", "ring"] = field(
        "allgather",
        "Attention under cp > 1: all-gather K/V (any mask, gloo or NCCL) or torch's ring SDPA (CUDA, causal, no "
        "document masking).",
    )
    ep: int = field(
        1,
        "Expert-parallel degree (MoE): routed experts split over this many of the dp_shard ranks, "
        "tokens exchanged by all-to-all (divides dp_shard and model.moe.num_experts).",
        gt=0,
    )
    pp_schedule: PipelineSchedule = field("1f1b", "Pipeline schedule.")
    pp_stages_per_rank: int = field(1, "Pipeline stages per rank (> 1 for interleaved schedules).", gt=0)
    sequence_parallel: bool = field(True, "Shard norms/activations along the sequence under TP.")
    loss_parallel: bool = field(True, "Keep logits vocab-sharded under TP and compute a parallel loss.")
    reshard_after_forward: bool | None = field(
        None, "FSDP2: free gathered params after forward (None = yes, except where unsafe)."
    )
    backend: str = field("cpu:gloo,cuda:nccl", "torch.distributed backend string.")
    timeout_s: int = field(
        1800,
        "Timeout of collectives, in seconds, at most 30 days (raised above an explicit resilience.hang_timeout_s).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )


class CheckpointSettings(Section):
    """Distributed checkpoints (DCP) with durable auto-resume."""

    dir: str | None = field(None, "Checkpoint directory (None = RUN_DIR/checkpoints).")
    interval: int = field(500, "Save every N steps (0 = only at the end and on signals).", ge=0)
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = field(
        "disabled", "Save synchronously, or in the background while training continues."
    )
    write_threads: int = field(
        2, "Writer threads per rank for a save (one shard file each; more overlap serialisation with the disk).", ge=1
    )
    copy_ahead_mb: int = field(
        64, "Per writer thread: MB copied device-to-host ahead of the write (GPU tensors in sync saves).", ge=1
    )
    load_threads: int = field(4, "Reader threads per rank for a load (shard files read in parallel).", ge=1)
    keep_last_n: int = field(3, "Keep this many complete checkpoints (0 = keep all).", ge=0)
    save_final: bool = field(True, "Save at the end of training even off the interval.")
    resume: Literal["auto", "never", "require"] = field(
        "auto", "Resume from RUN_DIR's latest checkpoint: auto (if any), never, require."
    )
    load_path: str | None = field(None, "Resume from this checkpoint instead of RUN_DIR's latest.")
    init_from: str | None = field(None, "Warm start: load weights only from this checkpoint (fresh optimizer, step 0).")
    exclude_from_loading: list[str] = field(list, "Parameter-name patterns not loaded by init_from.")


class MetricsSettings(Section):
    """Logging and experiment tracking (jsonl always on)."""

    log_interval: int = field(10, "Log metrics every N steps.", gt=0)
    backends: list[Literal["jsonl", "wandb", "mlflow", "tensorboard"]] = field(
        lambda: ["jsonl"], "Metrics backends; jsonl (RUN_DIR/metrics.jsonl) is always on."
    )
    run_name: str | None = field(None, "Run name in trackers (None = the run directory's name).")
    tags: list[str] = field(list, "Tags attached to the run in trackers.")
    wandb_project: str = field("kforge", "Weights & Biases project.")
    wandb_entity: str | None = field(None, "Weights & Biases entity (team or user).")
    wandb_group: str | None = field(None, "Weights & Biases run group.")
    wandb_mode: Literal["online", "offline", "auto"] = field(
        "auto", "W&B mode (auto = online with an API key and network, else offline)."
    )
    wandb_run_id: str | None = field(None, "W&B run id to continue (normally taken from the checkpoint).")
    mlflow_tracking_uri: str | None = field(
        None, "MLflow tracking URI: a server URL, or sqlite:///file.db (needs kforge[mlflow-server])."
    )
    mlflow_experiment: str = field("kforge", "MLflow experiment name.")
    mlflow_run_id: str | None = field(None, "MLflow run id to continue (normally taken from the checkpoint).")
    progress_bar: Literal["auto", "on", "off"] = field("auto", "Rich progress bar (auto = on a terminal).")
    peak_tflops: float | None = field(
        None, "Peak dense TFLOP/s per device for MFU (None = from the GPU name table).", gt=0
    )


class PlanSettings(Section):
    """The step-time cost model of `kforge plan` (and its search, trials and calibration; None = the GPU table).

    Defaults and their sources: docs/distributed.md ("The layout search"); fit them to
    measured trials with `kforge plan calibrate`, which writes this section.
    """

    mfu: float | None = field(
        None,
        "Model FLOP utilisation the compute time assumes (None: the GPU table's, e.g. 0.40 for H100).",
        gt=0,
        le=1,
    )
    intra_node_gbps: float | None = field(
        None, "Collective bandwidth per GPU inside a node, GB/s (None: the GPU table's, e.g. 360 for H100).", gt=0
    )
    inter_node_gbps: float | None = field(
        None, "Collective bandwidth per GPU between nodes, GB/s (None: the GPU table's, e.g. 40 for H100).", gt=0
    )
    hbm_gbps: float | None = field(
        None,
        "Memory bandwidth per GPU the optimizer step reads and writes at, GB/s (None: the GPU table's, e.g. 2680 "
        "for H100: 3.35 TB/s x 0.8).",
        gt=0,
    )
    fsdp_overlap: float = field(
        0.9, "Share of FSDP all-gather/reduce-scatter time hidden under compute (prefetch).", ge=0, le=1
    )
    tp_overlap: float = field(0.0, "Share of tensor-parallel collective time hidden under compute.", ge=0, le=1)
    cp_overlap: float = field(0.0, "Share of context-parallel K/V all-gather time hidden under compute.", ge=0, le=1)
    ep_overlap: float = field(0.0, "Share of expert-parallel all-to-all time hidden under compute.", ge=0, le=1)
    pp_overlap: float = field(
        0.5, "Share of pipeline send/receive time hidden under compute (asynchronous P2P).", ge=0, le=1
    )
    full_speed_tokens: int | None = field(
        None,
        "Tokens per micro-batch and rank from which matmuls run at the assumed MFU; fewer run proportionally slower "
        "(None: the GPU table's, 4096 for GPUs).",
        gt=0,
    )


class ProfilingSettings(Section):
    """A torch.profiler window writing one trace per rank."""

    enabled: bool = field(False, "Record a torch.profiler trace.")
    start_step: int = field(5, "First profiled step.", ge=0)
    end_step: int = field(8, "Last profiled step.", ge=0)
    trace_dir: str | None = field(None, "Trace directory (None = RUN_DIR/profile).")
    record_shapes: bool = field(False, "Record operator input shapes.")
    profile_memory: bool = field(False, "Record memory allocations.")
    with_stack: bool = field(False, "Record Python stacks.")
    memory_snapshot_steps: int = field(
        0,
        "CUDA only: record the allocator's history (every allocation with its stack) for the first N steps and "
        "write RUN_DIR/memory/rank<R>_steps<A>-<B>.pickle, for https://pytorch.org/memory_viz (0 = off).",
        ge=0,
    )
    memory_snapshot_max_entries: int = field(
        100_000, "Most allocation events the memory history keeps (older ones are dropped).", gt=0
    )


class ResilienceSettings(Section):
    """What to do with NaN/Inf losses, shutdown signals, hangs, slow ranks and loss spikes."""

    nan_policy: Literal["warn", "skip", "abort"] = field(
        "skip",
        "On a NaN/Inf loss or gradient norm: warn (apply the update anyway), skip the update, "
        "or abort (skip, and stop after nan_max_consecutive bad steps in a row; with fused AdamW or "
        "fp16 the count is read on logging steps, so the stop may come up to metrics.log_interval steps later).",
    )
    nan_max_consecutive: int = field(5, "abort policy: stop after this many consecutive bad steps.", gt=0)
    stop_check_interval: int = field(
        5,
        "Steps between the ranks' agreement on a shutdown signal (one process checks every step); "
        "keep interval x step time well inside the cluster's grace period between SIGTERM and SIGKILL.",
        gt=0,
    )
    shutdown_signals: list[str] = field(
        lambda: ["SIGTERM", "SIGUSR1", "SIGINT"],
        "Signals that stop training at the next step boundary after saving a checkpoint "
        "(a second SIGINT stops at once).",
    )
    hang_timeout_s: float | None = field(
        None,
        "Hang watchdog: seconds without progress in a training step before every rank writes its stacks to "
        "RUN_DIR/logs/hang/ and exits 76 (requeue). None = max(10 x the median step time, 300 s), capped below "
        "the process-group timeout; 0 = off. Evaluation, saves and the first steps get the cap "
        "(0.8 x the process-group timeout). At most 604800 (7 days).",
        ge=0,
        le=MAX_HANG_TIMEOUT_S,
    )
    hang_max_requeues: int = field(
        3, "Generated sbatch: requeue after a hang at most this many times in a row without a new checkpoint.", ge=0
    )
    straggler_ratio: float = field(
        1.5,
        "Straggler report: warn when one rank's local step work (data loading + optimizer update) takes this many "
        "times the median rank's for resilience.straggler_windows logging intervals in a row; 0 = no report "
        "(no all-gather).",
        ge=0,
    )
    straggler_windows: int = field(3, "Logging intervals in a row above straggler_ratio before the warning.", gt=0)
    exclude_stragglers: bool = field(
        False,
        "Under the generated sbatch script: when one rank stays above exclude_straggler_ratio for "
        "exclude_straggler_windows logging intervals in a row, record its SLURM node in RUN_DIR/logs/stragglers.jsonl, "
        "stop with a checkpoint (exit 75) and requeue the job without that node (see slurm.max_excluded_nodes). "
        "Needs the straggler report (straggler_ratio > 0).",
    )
    exclude_straggler_ratio: float = field(
        2.0, "exclude_stragglers: the slowest rank's local step work over the median rank's that counts.", gt=1
    )
    exclude_straggler_windows: int = field(
        10, "exclude_stragglers: logging intervals in a row above exclude_straggler_ratio before the job stops.", gt=0
    )
    spike_policy: Literal["off", "warn", "rewind"] = field(
        "off",
        "On a loss spike (loss > mean + spike_sigma x std and > spike_ratio x mean of the last spike_window steps): "
        "off, warn (a record and a warning), or rewind (restore the last complete checkpoint in-process, skip the "
        "data between it and the spike, continue).",
    )
    spike_window: int = field(100, "Loss spike guard: steps of history the threshold is computed from.", ge=4)
    spike_sigma: float = field(6.0, "Loss spike guard: standard deviations above the window's mean.", gt=0)
    spike_ratio: float = field(1.2, "Loss spike guard: the loss must also exceed this multiple of the mean.", ge=1)
    spike_max_rewinds: int = field(
        3, "rewind policy: at most this many rewinds per run; later spikes are only reported.", ge=0
    )


class SlurmSettings(Section):
    """The cluster shape and SLURM job options (also the default world size)."""

    nodes: int = field(1, "Number of nodes (nodes x gpus_per_node at most 1,048,576).", gt=0, le=MAX_WORLD_SIZE)
    gpus_per_node: int = field(1, "GPUs (= training processes) per node.", gt=0, le=MAX_WORLD_SIZE)
    min_nodes: int | None = field(
        None,
        "Shrink instead of waiting: start on as few as this many nodes (the job asks SLURM for "
        "--nodes=min_nodes-nodes); train re-plans the data-parallel degree for the processes it gets, keeps the "
        "global batch by gradient accumulation (or refuses, exit 2, when it cannot) and grows back to slurm.nodes "
        "at a later requeue. None = wait for slurm.nodes.",
        gt=0,
        le=MAX_WORLD_SIZE,
    )
    gpu_type: str = field("cpu", "Accelerator type: h100, h200, a100, cpu, ...")
    gpu_memory_gb: float = field(80.0, "Memory of one accelerator in GB.", gt=0)
    partition: str | None = field(None, "SLURM partition.")
    account: str | None = field(None, "SLURM account.")
    qos: str | None = field(None, "SLURM quality of service.")
    constraint: str | None = field(None, "SLURM node constraint.")
    time_limit: str = field("24:00:00", "Job time limit (SLURM --time).")
    cpus_per_task: int = field(8, "CPUs per training process.", gt=0)
    mem: str | None = field("0", "Memory per node (SLURM --mem; '0' = all).")
    job_name: str = field("kforge", "SLURM job name.")
    signal_before_s: int = field(300, "Send USR1 this many seconds before the time limit.", ge=0)
    network_interface: str | None = field(None, "NCCL/gloo socket interface (e.g. ib0).")
    extra_sbatch: list[str] = field(list, "Extra '#SBATCH' lines, e.g. '--exclusive'.")
    max_excluded_nodes: int = field(
        2,
        "Generated sbatch: at most this many nodes a hang (or, with resilience.exclude_stragglers, a straggler) "
        "named are left behind when the job requeues (RUN_DIR/excluded_nodes.json; the oldest goes back in past "
        "the cap), and never so many that the partition can no longer hold the job; 0 = never exclude.",
        ge=0,
    )
    env: dict[str, str] = field(dict, "Extra environment variables exported in the job script.")
    expand_env: bool = field(
        False, "Let the job's shell expand $NAME / ${NAME} in slurm.env values (e.g. '$SCRATCH/data'); else literal."
    )
    setup: list[str] = field(
        list, "Shell lines run before srun: 'module load cuda', 'source ~/venv/bin/activate', 'conda activate x'."
    )
    python: str | None = field(
        None,
        "Interpreter the tasks run (None: this one by absolute path, or `python` from the job's environment "
        "when slurm.setup is given).",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
