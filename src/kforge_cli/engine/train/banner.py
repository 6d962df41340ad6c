"""The start banner: what this run is, printed once (rank 0) before the first step.

A researcher reads the first screen to check the run is the one they meant: model size,
tokens per step, which data with which tokenizer, the mesh, device and threads (and why
that many), where the run's files go, how often it saves, and where the metrics are sent.
Every line is built from the resolved settings and the runtime, nothing is measured here.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import MAX_METADATA_BYTES, read_text_capped
from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.observe.curves import RESUMED
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.errors import KforgeError
from kforge_cli.settings import JobSettings
from kforge_cli.settings.data import DataSettings, EvalSettings
from kforge_cli.settings.explain import vision_param_counts
from kforge_cli.settings.infrastructure import CheckpointSettings, MetricsSettings
from kforge_cli.settings.training import ModelSettings, TrainSettings
from kforge_cli.settings.vlm import VLMSettings
from kforge_cli.version import __version__

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")


def count(n: int, one: str, many: str | None = None) -> str:
    """``1 step``, ``2 steps``, ``1,000 tokens``."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def params_text(n: float) -> str:
    """``862.3K``, ``124.4M``, ``7.25B`` parameters."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:,.0f}"


def model_line(settings: JobSettings) -> str:
    m = settings.model
    family = family_for(m)
    text = family.param_count(m)
    total = text + sum(v for v in vision_param_counts(settings).values() if v is not None)
    active = family.param_count(m, active=True) + (total - text)
    size = f"{params_text(total)} parameters" + (
        f" ({params_text(active)} active per token)" if active != total else ""
    )
    return f"model: {size}, dim {m.dim}, {count(m.n_layers, 'layer')}, {count(m.n_heads, 'head')} ({m.kv_heads} kv), vocab {m.vocab_size}"


def step_line(t: TrainSettings, dp: int) -> str:
    tokens = t.tokens_per_step(dp)
    accum = f" x {t.grad_accum_steps} accumulation" if t.grad_accum_steps > 1 else ""
    return (
        f"step: {count(tokens, 'token')} (batch {t.batch_size} x seq {t.seq_len}{accum} x dp {dp}); "
        f"{count(t.max_steps, 'step')} = {tokens * t.max_steps:,} tokens"
    )


def _prepared_tokens(path: str) -> tuple[str, int | None, int | None]:
    """(tokenizer, train tokens, val tokens) from a prepared directory's metadata.json."""
    try:
        meta = json.loads(read_text_capped(Path(path) / "metadata.json", MAX_METADATA_BYTES, "metadata"))
        tok = meta.get("tokenizer", {})
        name = "byte" if tok.get("kind") == "byte" else str(tok.get("file") or "tokenizer.json")
        splits = meta.get("splits", {})
        return name, splits.get("train", {}).get("tokens"), splits.get("val", {}).get("tokens")
    except (OSError, ValueError, AttributeError, RecursionError, KforgeError):
        return "?", None, None


def _tokens_text(train: int | None, val: int | None) -> str:
    if train is None:
        return "tokens unknown"
    return f"{train:,} train + {val or 0:,} val tokens"


def data_line(data: DataSettings, vlm: VLMSettings | None) -> str:
    if vlm is not None:
        return f"data: {vlm.data_path or 'the built-in image-caption corpus'} (VLM, {vlm.arch})"
    if data.datasets:
        parts = []
        for d in data.datasets:
            tok, train, val = _prepared_tokens(d.path)
            parts.append(f"{d.name} {d.path} (weight {d.weight:g}, {_tokens_text(train, val)})")
        tok = _prepared_tokens(data.datasets[0].path)[0]
        return f"data: mixture of {count(len(parts), 'dataset')}, {tok} tokenizer: " + "; ".join(parts)
    if data.path:
        tok, train, val = _prepared_tokens(data.path)
        return f"data: {data.path} ({tok} tokenizer, {_tokens_text(train, val)})"
    from kforge_cli.engine.data.builtin_corpus import builtin_tokens

    tokens = builtin_tokens()
    return (
        f"data: the built-in demo corpus (byte tokenizer, {_tokens_text(len(tokens['train']), len(tokens['val']))}; "
        "set data.path to train on your own)"
    )


def mesh_line(runtime: RuntimeContext) -> str:
    d = runtime.dims
    parts = [f"pp={d.pp}", f"dp_replicate={d.dp_replicate}", f"dp_shard={d.dp_shard}"]
    parts += [f"cp={d.cp}"] if d.cp > 1 else []
    parts += [f"tp={d.tp}"] + ([f"ep={d.ep}"] if d.ep > 1 else [])
    return f"mesh: {count(runtime.world_size, 'process', 'processes')}, {' '.join(parts)}"


def device_line(runtime: RuntimeContext, dtype: str) -> str:
    line = f"device: {runtime.device}, compute {dtype}"
    if runtime.threads is not None:
        line += f", {runtime.threads.describe()}"
    return line


def checkpoint_line(c: CheckpointSettings, checkpoint_dir: Path) -> str:
    every = f"every {count(c.interval, 'step')}" if c.interval else "no interval (only at the end and on signals)"
    keep = f", keep the last {c.keep_last_n}" if c.keep_last_n else ", keep all"
    final = ", and at the end" if c.save_final and c.interval else ""
    return f"checkpoints: {every}{final}{keep} -> {checkpoint_dir}"


def eval_line(e: EvalSettings, train: TrainSettings, batches: int) -> str:
    if not e.interval:
        return "eval: off (eval.interval = 0)"
    size = e.batch_size or train.batch_size
    return (
        f"eval: every {count(e.interval, 'step')} and at the end, {count(batches, 'held-out batch', 'held-out batches')}"
        f" of {size} x {train.seq_len} tokens"
    )


def trackers_line(m: MetricsSettings, run_dir: Path) -> str:
    shown = [f"jsonl ({run_dir / 'metrics.jsonl'})"]
    for name in m.backends:
        if name == "wandb":
            shown.append(f"wandb (project {m.wandb_project}, {m.wandb_mode})")
        elif name == "mlflow":
            uri = m.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default"
            shown.append(f"mlflow ({uri}, experiment {m.mlflow_experiment})")
        elif name == "tensorboard":
            shown.append(f"tensorboard ({run_dir / 'tensorboard'})")
    return "trackers: " + ", ".join(shown)


def start_banner(
    settings: JobSettings,
    runtime: RuntimeContext,
    run_dir: Path,
    *,
    checkpoint_dir: Path,
    dtype: str,
    eval_batches: int,
    start_step: int = 0,
) -> list[str]:
    """The banner's lines (the first one names the run; the rest are indented facts)."""
    what = settings.profile or "a custom config"
    start = f", resuming after step {start_step:,}" if start_step else ""
    lines = [
        f"kforge {__version__}: training {what}{start}",
        model_line(settings),
        step_line(settings.train, runtime.dp_size),
        data_line(settings.data, settings.vlm),
        mesh_line(runtime),
        device_line(runtime, dtype),
        f"run dir: {run_dir}",
        checkpoint_line(settings.checkpoint, checkpoint_dir),
        eval_line(settings.eval, settings.train, eval_batches),
        trackers_line(settings.metrics, run_dir),
    ]
    return [lines[0], *(f"  {line}" for line in lines[1:])]


def building_line(model: ModelSettings, runtime: RuntimeContext) -> str:
    """The line shown while the model and data are built (seconds on a CPU, minutes for a large model)."""
    total = family_for(model).param_count(model)
    return f"building the model ({params_text(total)} parameters) and the data on {runtime.device} ..."


def announce_start(session: TrainingSession) -> None:
    """Log the banner of ``session``; a job that resumed the run also writes ``{"step", "resumed": true}``
    to metrics.jsonl (kforge plot marks it). Call on rank 0, after the restore, before the first step."""
    from kforge_cli.engine.evaluation.in_loop import eval_batches
    from kforge_cli.engine.runtime import dtype_name
    from kforge_cli.rundir.layout import RunDir

    s = session.settings
    lines = start_banner(
        s,
        session.runtime,
        session.run_dir,
        checkpoint_dir=RunDir(session.run_dir).checkpoint_root(s),
        dtype=dtype_name(session.compute_dtype),
        eval_batches=eval_batches(s, pipeline=session.pipeline is not None),
        start_step=session.state.step,
    )
    for line in lines:
        log.info(line)
    restored = session.checkpointer.restored
    if restored is not None and restored.kind == "resume":
        session.metrics.write({"step": session.state.step, RESUMED: True})
