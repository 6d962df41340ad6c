"""`kforge export-hf`: a kforge checkpoint -> Hugging Face Llama safetensors + ``config.json``.

Streams: each output shard's tensors are read from the DCP checkpoint (reassembling
however it was sharded), renamed (``hf_format``), written, and freed, so memory stays
around one shard. The directory is written under a temporary name and renamed when
complete, so a crashed export never leaves something that looks loadable.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.checkpoint.errors import CheckpointError
from kforge_cli.engine.checkpoint.hf_format import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    export_problems,
    hf_config,
    to_hf_name,
)
from kforge_cli.engine.checkpoint.reader import (
    MODEL_PREFIX,
    CheckpointView,
    TensorEntry,
    is_vlm,
    model_settings_of,
    open_checkpoint,
    read_tensors,
    shaping_of,
)
from kforge_cli.engine.runtime.dtypes import DTYPES, torch_dtype_name

DEFAULT_SHARD_BYTES = 5 * 2**30


@dataclass
class ExportResult:
    out_dir: Path
    files: list[str]
    tensors: int
    params: int
    dtype: str
    step: int | None
    config: dict[str, Any]


def _stored_dtype(entries: list[TensorEntry]) -> torch.dtype:
    kinds = {e.dtype for e in entries}
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in DTYPES.values() else torch.float32


def _plan(entries: list[TensorEntry], itemsize: int, max_bytes: int) -> list[list[TensorEntry]]:
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        nbytes = e.numel * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def _check_exportable(view: CheckpointView) -> dict[str, Any]:
    if not view.complete:
        raise CheckpointError(
            f"{view.path} is an incomplete checkpoint (its save never finished); export an earlier one"
        )
    fields = {k.removeprefix(MODEL_PREFIX): v for k, v in shaping_of(view).items() if k.startswith(MODEL_PREFIX)}
    problems = export_problems(fields, is_vlm(view))
    if problems:
        raise CheckpointError(f"cannot export {view.path} as a Hugging Face Llama: " + "; ".join(problems))
    return fields


def _prepare_out(out_dir: Path, overwrite: bool) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} exists and is not empty; choose another directory or pass --overwrite")
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> ExportResult:
    """Write `checkpoint`'s model as ``LlamaForCausalLM`` weights in `out_dir`.

    `dtype` is ``fp32``/``bf16``/``fp16`` (default: the checkpoint's own dtype). Text
    models with RMSNorm, SwiGLU and no QK-norm only: anything else is refused with the reason.
    """
    from safetensors.torch import save_file

    view = open_checkpoint(checkpoint)
    fields = _check_exportable(view)
    cfg = model_settings_of(view)
    entries = sorted(view.model_entries(), key=lambda e: e.key)
    names = {e.key: to_hf_name(e.key.removeprefix(MODEL_PREFIX)) for e in entries}
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    target = DTYPES[dtype] if dtype else _stored_dtype(entries)
    out = Path(out_dir).expanduser().resolve()
    tmp = _prepare_out(out, overwrite)
    try:
        shards = _plan(entries, target.itemsize, max_shard_bytes)
        files = (
            [SINGLE_FILE]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map: dict[str, str] = {}
        for shard, file in zip(shards, files, strict=True):
            loaded = read_tensors(view, [e.key for e in shard], dtype=target)
            tensors = {names[k]: t.contiguous() for k, t in loaded.items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in tensors})
            del loaded, tensors
        if len(files) > 1:
            total = sum(e.numel for e in entries) * target.itemsize
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config(fields, ffn_hidden_dim=cfg.resolved_ffn_hidden_dim, torch_dtype=torch_dtype_name(target))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out, files, len(entries), sum(e.numel for e in entries), torch_dtype_name(target), view.step, config
    )
