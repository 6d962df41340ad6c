"""Sections for the data pipeline and evaluation."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kforge_cli.settings.section import Section, field


class DatasetSpec(Section):
    """One dataset of a mixture."""

    name: str = field(..., "Name used in logs and in phase weights.")
    path: str = field(..., "A directory made by `kforge prepare-data`.")
    weight: float = field(1.0, "Sampling weight before temperature.", gt=0)


class DataPhase(Section):
    """A data phase (e.g. an annealing phase) starting at a given step."""

    start_step: int = field(..., "First optimizer step of this phase.", ge=0)
    dataset_weights: dict[str, Annotated[float, Field(ge=0)]] = field(
        dict, "Mixture weights by dataset name for this phase (>= 0; 0 turns a dataset off)."
    )
    lr_scale: float = field(1.0, "Multiplier on the scheduled learning rate during this phase.", gt=0)


class DataSettings(Section):
    """Training data: a prepared token directory, or a weighted mixture with phases."""

    path: str | None = field(None, "Prepared data directory (`kforge prepare-data`); None = the built-in demo corpus.")
    tokenizer: str = field("byte", "Tokenizer: 'byte' or a path to a Hugging Face tokenizer.json.")
    datasets: list[DatasetSpec] = field(list, "A mixture of prepared datasets (instead of data.path).")
    temperature: float = field(1.0, "Mixture temperature: weights ** (1/temperature), renormalised.", gt=0)
    phases: list[DataPhase] = field(list, "Data phases by start step (mixture weights, lr_scale).")
    document_masking: bool = field(False, "Keep attention and labels inside document boundaries.")
    num_workers: int = field(0, "Data loader worker processes per rank.", ge=0)
    prefetch_factor: int = field(2, "Batches prefetched per worker (num_workers > 0).", gt=0)
    pin_memory: bool = field(True, "Pin host memory for faster copies to the GPU.")
    allow_changed_data: bool = field(
        False,
        "Resume a checkpoint on data whose fingerprint differs from the one it trained on (re-prepared "
        "or changed data): the order continues at the same position on the new data, not exactly. "
        "For one command; typing data.path or data.datasets on it does the same.",
    )


class EvalSettings(Section):
    """Periodic evaluation on the validation split."""

    interval: int = field(0, "Evaluate every N steps (0 = never).", ge=0)
    steps: int = field(10, "Batches per evaluation.", gt=0)
    path: str | None = field(None, "Prepared eval data directory (None = the val split of data.path).")
    batch_size: int | None = field(None, "Eval micro-batch size (None = train.batch_size).", gt=0)
    tasks: list[str] = field(
        list, "Multiple-choice JSONL files (context, choices, answer) scored every eval.interval (not under PP)."
    )
    after_checkpoint: bool = field(
        False,
        "Evaluate every committed checkpoint with `kforge eval` in a process of its own (a small job of "
        "its own under SLURM), never blocking training: results in RUN_DIR/eval/step_N.json.",
    )
    after_checkpoint_tasks: list[str] = field(
        lambda: ["heldout"],
        "The `kforge eval --task` specs eval.after_checkpoint runs (held-out: the first eval.steps batches).",
    )
    after_checkpoint_device: Literal["cpu", "cuda"] = field(
        "cpu", "Where eval.after_checkpoint evaluates ('cuda': a GPU of its own, e.g. a SLURM job's)."
    )
    after_checkpoint_launcher: Literal["auto", "process", "sbatch"] = field(
        "auto",
        "How eval.after_checkpoint starts an evaluation: a detached local process, or `sbatch` (a job "
        "of its own); auto = sbatch inside a SLURM job, else a process.",
    )
    after_checkpoint_sbatch_args: list[str] = field(
        list, "Extra sbatch options of an evaluation's job (e.g. --partition=eval, --gres=gpu:1, --time=30)."
    )
