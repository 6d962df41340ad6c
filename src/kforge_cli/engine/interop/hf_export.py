"""`kforge export-hf`: a kforge checkpoint -> Hugging Face safetensors + ``config.json``,
``generation_config.json`` and the run's tokenizer (``hf_tokenizer``), as the ``transformers``
architecture that holds the model exactly (Llama / Qwen3 dense, the MoE ones of ``hf_moe``,
LLaVA for a vision-language model, ``hf_vlm``).

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
from typing import Protocol

import torch

from kforge_cli.common.files import output_dir, private_dir_beside, swap_in
from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
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
from kforge_cli.engine.families.base import HFExport
from kforge_cli.engine.interop.hf_family import export_problems, family_of_fields
from kforge_cli.engine.interop.hf_format import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from kforge_cli.engine.interop.hf_tokenizer import ExportedTokenizer, run_tokenizer, write_tokenizer
from kforge_cli.engine.runtime.dtypes import DTYPES, torch_dtype_name
from kforge_cli.rundir.layout import kforge_contents
from kforge_cli.settings.training import ModelSettings


class ExportPlan(Protocol):
    """What `export_hf` needs to know of a model: names, tensor transforms, config, extra files."""

    @property
    def hf_class(self) -> str: ...

    @property
    def text_settings(self) -> ModelSettings: ...

    def name(self, key: str) -> str | None: ...

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def config(self, torch_dtype: str) -> dict[str, object]: ...

    def write_extras(self, out: Path, tokenizer: ExportedTokenizer | None) -> None: ...


@dataclass(frozen=True)
class TextPlan:
    """A text model: its family's exporter (names, tensors, config)."""

    export: HFExport
    text_settings: ModelSettings

    @property
    def hf_class(self) -> str:
        return self.export.hf_class

    def name(self, key: str) -> str | None:
        return self.export.name(key)

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.export.tensors(key, t)

    def config(self, torch_dtype: str) -> dict[str, object]:
        return self.export.config(torch_dtype)

    def write_extras(self, out: Path, tokenizer: ExportedTokenizer | None) -> None:
        return None


DEFAULT_SHARD_BYTES = 5 * 2**30


@dataclass
class ExportResult:
    out_dir: Path
    files: list[str]
    tensors: int
    params: int
    dtype: str
    step: int | None
    config: dict[str, object]
    tokenizer: ExportedTokenizer | None = None
    hf_class: str = "LlamaForCausalLM"


GENERATION_CONFIG_FILE = "generation_config.json"


def _normal_permissions(directory: Path) -> None:
    """rw for whoever the umask allows (safetensors writes 0600 whatever the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~mask)
    directory.chmod(0o777 & ~mask)


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


def _check_exportable(view: CheckpointView) -> dict[str, object]:
    if not view.complete:
        raise CheckpointError(
            f"{view.path} is an incomplete checkpoint (its save never finished); export an earlier one"
        )
    fields = {k.removeprefix(MODEL_PREFIX): v for k, v in shaping_of(view).items() if k.startswith(MODEL_PREFIX)}
    problems = export_problems(fields, is_vlm(view))
    if problems:
        raise CheckpointError(f"cannot export {view.path} to Hugging Face: " + "; ".join(problems))
    return fields


EXPORT_MARKER = "kforge_export.json"  # what an export wrote: the proof --overwrite needs
EXPORT_FORMAT = "kforge-export-hf"


def _not_an_earlier_export(out_dir: Path) -> str | None:
    """Why `out_dir` is not provably an earlier export (None when it is).

    It must hold this command's marker (a regular file) naming every entry, and nothing
    else: only regular files, no directories, no links. A folder holding a run, a source
    tree or anything the user added is never replaced.
    """
    owned = kforge_contents(out_dir)
    if owned:
        return f"it holds a kforge run or checkpoint ({owned})"
    marker = out_dir / EXPORT_MARKER
    if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 2**20:
        return f"it has no {EXPORT_MARKER} (every kforge export-hf writes one)"
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"its {EXPORT_MARKER} is unreadable"
    files = record.get("files") if isinstance(record, dict) else None
    if record.get("format") != EXPORT_FORMAT or not isinstance(files, list):
        return f"its {EXPORT_MARKER} is not an export-hf record"
    listed = {f for f in files if isinstance(f, str) and f and "/" not in f and f not in (".", "..")}
    listed.add(EXPORT_MARKER)
    foreign = sorted(
        e.name for e in os.scandir(out_dir) if e.name not in listed or not e.is_file(follow_symlinks=False)
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"it holds what the export did not write ({shown})"
    return None


def _prepare_out(out_dir: Path, overwrite: bool, source: Path) -> Path:
    if source.resolve().is_relative_to(out_dir.resolve()):
        raise CheckpointError(f"{out_dir} holds the checkpoint being exported ({source}): choose another directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{out_dir} exists and is not empty; choose another directory or pass --overwrite")
        why = _not_an_earlier_export(out_dir)
        if why is not None:
            raise CheckpointError(
                f"refusing to overwrite {out_dir}: {why}; --overwrite only replaces an earlier export of "
                "kforge export-hf. Choose another directory"
            )
    return private_dir_beside(out_dir)


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    tokenizer: str | None = None,
) -> ExportResult:
    """Write `checkpoint`'s model in `out_dir` as the ``transformers`` architecture that holds it.

    Dense: ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with QK-norm); MoE:
    ``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM`` or ``Ernie4_5_MoeForCausalLM``
    (``hf_moe``); a vision-language model: ``LlavaForConditionalGeneration`` (``hf_vlm``).
    What none holds is refused with the fields named. `dtype` is ``fp32``/``bf16``/``fp16``
    (default: the checkpoint's own dtype). `tokenizer` is ``byte``, a tokenizer.json path,
    ``none`` (write none), or None: the one the run trained with (from its config.toml;
    none when there is no config.toml).
    """
    view = open_checkpoint(checkpoint)
    if not view.complete:
        raise CheckpointError(
            f"{view.path} is an incomplete checkpoint (its save never finished); export an earlier one"
        )
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if is_vlm(view):
        from kforge_cli.engine.interop.hf_vlm import vlm_export_plan

        plan = vlm_export_plan(view)
    else:
        plan = _text_plan(view)
    entries = sorted(view.model_entries(), key=lambda e: e.key)
    entries = [e for e in entries if plan.name(e.key.removeprefix(MODEL_PREFIX)) is not None]
    target = DTYPES[dtype] if dtype else _stored_dtype(entries)
    out = output_dir(out_dir, "output")  # a link is refused, never resolved
    tmp = _prepare_out(out, overwrite, view.path)
    try:
        files, count = _write_weights(view, entries, plan, target, max_shard_bytes, tmp)
        config = plan.config(torch_dtype_name(target))
        cfg = plan.text_settings
        spec = run_tokenizer(view.path) if tokenizer is None else tokenizer
        exported = None if spec in (None, "none") else write_tokenizer(spec, tmp, cfg.max_seq_len)
        if exported is not None:
            # kforge trains documents separated by EOS (no BOS): EOS also starts a document.
            ids = {"bos_token_id": exported.eos_id, "eos_token_id": exported.eos_id}
            config.update(ids)
            text_config = config.get("text_config")
            if isinstance(text_config, dict):
                text_config.update(ids)
            # No max_length: with it, every generate(max_new_tokens=...) warns that both are set
            # (config.json's max_position_embeddings already states the context length).
            generation = dict(ids)
            (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        plan.write_extras(tmp, exported)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written = sorted(p.name for p in tmp.iterdir())
        marker = {"format": EXPORT_FORMAT, "files": written, "source": str(view.path), "step": view.step}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _normal_permissions(tmp)
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(e.numel for e in entries)
    return ExportResult(out, files, count, params, torch_dtype_name(target), view.step, config, exported, plan.hf_class)


def _text_plan(view: CheckpointView) -> TextPlan:
    fields = _check_exportable(view)
    family = family_of_fields(fields)
    assert family.hf is not None  # _check_exportable refused a family without a mapping
    cfg = model_settings_of(view)
    return TextPlan(family.hf.exporter(fields, cfg), cfg)


def _write_weights(
    view: CheckpointView,
    entries: list[TensorEntry],
    plan: ExportPlan,
    target: torch.dtype,
    max_shard_bytes: int,
    tmp: Path,
) -> tuple[list[str], int]:
    """The safetensors shards (and index) of `entries` in `tmp`: (file names, tensors written)."""
    from safetensors.torch import save_file

    shards = _plan(entries, target.itemsize, max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for shard, file in zip(shards, files, strict=True):
        loaded = read_tensors(view, [e.key for e in shard], dtype=target)
        tensors: dict[str, torch.Tensor] = {}
        for key, t in loaded.items():
            tensors.update(plan.tensors(key.removeprefix(MODEL_PREFIX), t))
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() for t in tensors.values()) * target.itemsize
        del loaded, tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files, len(weight_map)
