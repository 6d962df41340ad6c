"""Every file and folder name inside a run directory and its checkpoints (the one place they are spelled).

    RUN_DIR/
      config.toml              the resolved settings, written once when the run starts
      config_changes.jsonl     accepted changes of later commands (resume), one JSON line each
      data_positions.jsonl     where the data order stood when each job (or rewind) began (data-trace)
      metrics.jsonl            one JSON object per logged step (and per checkpoint, per eval)
      logs/                    rank_R.log, slurm-JOBID.out; hang/ (the hang watchdog's reports)
      checkpoints/             step_N/ (see below), `latest` (unless checkpoint.dir) and
                               data_skips.json (data a loss-spike rewind skipped)
      tokenizer.json           a copy of the training data's Hugging Face tokenizer
      job.sbatch               the SLURM job script (--sbatch)
      slurm_jobs.jsonl         the job ids --submit submitted, one JSON line each
      eval/step_N.json         `kforge eval` results
      eval/step_N.status.json  the state of eval.after_checkpoint's evaluation of step N (running, done, failed)
      profile/, tensorboard/   torch.profiler traces, TensorBoard event files
      memory/                  CUDA memory snapshots: rankR_stepsA-B.pickle (profiling.memory_snapshot_steps),
                               rankR_oom.pickle (the allocator at an out-of-memory error)
      .kforge-lock             held by the live run (pid, host, SLURM job)
      launch.json              how the last job was started (launcher, processes, mesh)
      exit.json                how the last job ended (exit code, step), written by the CLI

    step_N/
      .metadata, __R_0.distcp  DCP shards (or pp_S/ subdirectories, one per pipeline stage)
      train_state.json         step, scheduler, data loader, NaN guard, run ids, fingerprint
      train_state/rank_R.*     per-rank RNG state
      metadata.json            a human-readable summary (inspect-ckpt)
      kforge_commit.json       written last: the checkpoint counts
      kforge_eval_pin.json     an evaluation holds this checkpoint: retention keeps it (pid, host)

Imports nothing, so any module may use these names.
"""

from __future__ import annotations

CONFIG_FILE = "config.toml"
CONFIG_CHANGES_FILE = "config_changes.jsonl"
DATA_POSITIONS_FILE = "data_positions.jsonl"
METRICS_FILE = "metrics.jsonl"
LOGS_DIR = "logs"
HANG_DIR = "hang"  # inside logs/
HANG_SUMMARY_FILE = "summary.txt"  # inside logs/hang/
CHECKPOINTS_DIR = "checkpoints"
TOKENIZER_FILE = "tokenizer.json"  # the same name as in a prepared data directory and a Hugging Face one
JOB_SCRIPT = "job.sbatch"
SLURM_JOBS_FILE = "slurm_jobs.jsonl"
EVAL_DIR = "eval"
EVAL_STATUS_SUFFIX = ".status.json"  # inside eval/: step_N.status.json
PROFILE_DIR = "profile"
TENSORBOARD_DIR = "tensorboard"
MEMORY_DIR = "memory"
MEMORY_STEPS_FILE = "rank{rank}_steps{first}-{last}.pickle"  # inside memory/: str.format(rank=, first=, last=)
MEMORY_OOM_FILE = "rank{rank}_oom.pickle"  # inside memory/: str.format(rank=)
LOCK_FILE = ".kforge-lock"
LAUNCH_FILE = "launch.json"
EXIT_FILE = "exit.json"

COMMIT_FILE = "kforge_commit.json"
EVAL_PIN_FILE = "kforge_eval_pin.json"  # inside step_N/: an evaluation of it is running
LATEST_FILE = "latest"
DATA_SKIPS_FILE = "data_skips.json"  # beside step_N/: data a loss-spike rewind skipped
TRAIN_STATE_FILE = "train_state.json"
SUMMARY_FILE = "metadata.json"
RANK_STATE_DIR = "train_state"
DCP_METADATA = ".metadata"
