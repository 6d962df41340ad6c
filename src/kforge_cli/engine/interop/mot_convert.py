"""Dense text weights -> a Mixture-of-Transformers model: `kforge convert-mot` and `vlm.mot_warm_start_from`.

Name mapping (engine.model.vlm.mot): the MoT parameter
``layers.<i>.experts.<modality>.<rest>`` starts from the dense ``layers.<i>.<rest>`` for
*every* modality; the embedding, final norm and head are shared and copied as
they are; ``vision.*`` and ``adapter.*`` have no dense counterpart and keep their fresh
initialisation. So right after the conversion, text-only input gives the dense model's
logits, and the text experts equal the dense weights whatever else is in the sequence.

The source is a kforge checkpoint (a step dir or a run dir, any world size / pipeline
split: DCP loads straight into this rank's shards) or a Hugging Face Llama directory.
Its model shape must be the MoT config's ``[model]``; a difference is an error naming
the fields. ``vlm.mot_warm_start_from`` applies this at step 0 of a *fresh* run only: a
resume of a MoT run never re-applies it.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kforge_cli.common.files import output_dir, private_dir_beside, swap_in
from kforge_cli.common.json_values import dict_of
from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.checkpoint.dcp_io import OPTIONS, load_from_dirs, quiet_single_process
from kforge_cli.engine.checkpoint.resolve import freeze_config
from kforge_cli.engine.checkpoint.train_state import FORMAT
from kforge_cli.engine.interop.hf_import import check_matches, read_hf_tensors
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.checkpoints import atomic_write_json, dcp_dirs, is_hf_dir, read_json, resolve_checkpoint
from kforge_cli.rundir.fingerprint import fingerprint, shaping_config
from kforge_cli.rundir.names import COMMIT_FILE, SUMMARY_FILE, TRAIN_STATE_FILE
from kforge_cli.settings import JobSettings
from kforge_cli.version import __version__

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kforge_cli.engine.checkpoint.restore import Restored

log = logging.getLogger("kforge")

_EXPERT = re.compile(r"^layers\.(\d+)\.experts\.([^.]+)\.(.+)$")


def dense_name(name: str) -> str | None:
    """The dense parameter a MoT parameter starts from (None: encoder/adapter, no dense counterpart)."""
    if name.startswith(("vision.", "adapter.")):
        return None
    m = _EXPERT.match(name)
    return f"layers.{m.group(1)}.{m.group(3)}" if m else name


def _check_dense_shape(path: Path, settings: JobSettings) -> None:
    """The kforge source must be a text model of exactly this config's [model] shape."""
    state = read_json(path / TRAIN_STATE_FILE)
    theirs = dict_of(state.get("shaping") or {}, f"{path / TRAIN_STATE_FILE}: shaping")
    if any(k.startswith("vlm.") for k in theirs):
        raise CheckpointError(f"{path} is already a vision-language checkpoint; convert-mot takes a dense text one")
    ours = shaping_config(settings)
    wrong = [
        f"model.{k[6:]}: checkpoint {theirs.get(k)!r}, config {ours[k]!r}"
        for k in sorted(ours)
        if k.startswith("model.") and k in theirs and theirs[k] != ours[k]
    ]
    if wrong:
        fix = " ".join(
            f"--model.{k[6:]}={theirs[k]}"
            for k in sorted(ours)
            if k.startswith("model.") and k in theirs and theirs[k] != ours[k]
        )
        raise CheckpointError(
            f"{path} is a differently shaped text model ({'; '.join(wrong)}); build the same one: {fix}"
        )


def load_dense_into_mot(
    model: nn.Module, source: str | Path, settings: JobSettings, group: ProcessGroup | None = None
) -> list[str]:
    """Copy a dense text model's weights into every modality of ``model`` (a MoT VLM, sharded or not).

    Collective under a process group (every rank loads its shards). Returns the MoT
    parameter names that were set.
    """
    src = Path(source).expanduser().resolve()
    local = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=OPTIONS))
    mapping = {n: d for n in local if (d := dense_name(n)) is not None}
    if not any(_EXPERT.match(n) for n in mapping):
        raise InvalidInputError("the model has no MoT experts: set vlm.arch = 'mot' to convert dense weights into it")
    if is_hf_dir(src):
        check_matches(settings.model, src)
        tensors = read_hf_tensors(src, set(mapping.values()))
        missing = sorted(set(mapping.values()) - set(tensors))
        if missing:
            raise CheckpointError(f"{src} has no weights for {', '.join(missing[:8])}")
        full: dict[str, Any] = {n: tensors[d].to(local[n].dtype) for n, d in mapping.items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        return sorted(full)
    path = resolve_checkpoint(src)
    _check_dense_shape(path, settings)
    primary: dict[str, torch.Tensor] = {}  # dense name -> the tensor it is loaded into (first modality's)
    for n, d in mapping.items():
        primary.setdefault(d, local[n])
    state: dict[str, Any] = {"model": dict(primary)}
    missing_keys = load_from_dirs(state, dcp_dirs(path), group)
    if missing_keys:
        names = sorted(k.removeprefix("model.") for k in missing_keys)
        raise CheckpointError(f"{path} has no weights for {', '.join(names[:8])}: is it a kforge text checkpoint?")
    with torch.no_grad():
        for n, d in mapping.items():
            loaded = state["model"][d]
            if local[n] is not loaded:
                local[n].copy_(loaded)  # same shape, same sharding: the other modalities' copies
    loaded_state: dict[str, Any] = {n: local[n] for n in mapping}
    set_model_state_dict(model, loaded_state, options=StateDictOptions(strict=False))
    return sorted(mapping)


def maybe_mot_warm_start(
    settings: JobSettings, model: nn.Module, restored: Restored | None, group: ProcessGroup | None = None
) -> bool:
    """Apply ``vlm.mot_warm_start_from`` when this is a fresh run (step 0); True when applied."""
    vlm = settings.vlm
    if vlm is None or not vlm.mot_warm_start_from:
        return False
    if restored is not None:
        how = "resumed" if restored.kind == "resume" else "warm-started by checkpoint.init_from"
        log.info("vlm.mot_warm_start_from not applied: the run %s from %s", how, restored.path)
        return False
    if vlm.arch != "mot":
        raise InvalidInputError(f"vlm.mot_warm_start_from needs vlm.arch = 'mot' (this run has {vlm.arch!r})")
    names = load_dense_into_mot(model, vlm.mot_warm_start_from, settings, group)
    log.info("MoT warm start: %d tensors from the dense model %s (step 0)", len(names), vlm.mot_warm_start_from)
    return True


@dataclass
class ConvertResult:
    path: Path
    tensors: int
    parameters: int


def _summary(settings: JobSettings, src: Path) -> tuple[dict[str, object], dict[str, object]]:
    shaping = shaping_config(settings)
    fp = fingerprint(shaping)
    state = {
        "format": FORMAT,
        "step": 0,
        "progress": {"step": 0, "tokens_seen": 0},
        "fingerprint": fp,
        "shaping": shaping,
        "freeze": freeze_config(settings),
        "world_size": 1,
        "load_path": None,
        "converted_from": str(src),
        "kind": "convert-mot",
        "weights_only": True,  # no optimizer or RNG state: a warm start, complete as it is
    }
    summary = {
        "format": "kforge-checkpoint",
        "version": FORMAT,
        "step": 0,
        "tokens_seen": 0,
        "reason": "convert-mot",
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "world_size": 1,
        "dcp_dirs": ["."],
        "fingerprint": fp,
        "model": shaping,
        "profile": settings.profile,
        "kforge_version": __version__,
        "torch_version": torch.__version__,
    }
    return state, summary


def convert_mot(settings: JobSettings, source: str | Path, out: str | Path) -> ConvertResult:
    """Write a MoT checkpoint (model weights, step 0) to ``out``, on CPU in one process.

    ``out`` becomes a complete kforge checkpoint directory: use it as
    ``--checkpoint.init_from=OUT`` (inspect-ckpt reads it). Vision encoder and adapter get
    the fresh initialisation of ``train.seed``.
    """
    from kforge_cli.engine.model.vlm import build_vlm

    if settings.vlm is None or settings.vlm.arch != "mot":
        raise InvalidInputError(
            "convert-mot needs a MoT configuration (vlm.arch = 'mot'); e.g. --profile vlm-mot-debug"
        )
    src, dst = Path(source).expanduser().resolve(), output_dir(out, "output")  # a link is refused, not resolved
    if dst.exists() and any(dst.iterdir()):
        raise InvalidInputError(f"{dst} exists and is not empty; give a new output directory")
    torch.manual_seed(settings.train.seed)
    with torch.device("cpu"):
        model = build_vlm(settings)
    names = load_dense_into_mot(model, src, settings)
    tmp = private_dir_beside(dst)  # fresh and unpredictable: nothing someone else made is removed or reused
    try:
        with quiet_single_process():
            dcp_save(
                {"model": get_model_state_dict(model, options=OPTIONS)},
                storage_writer=FileSystemWriter(tmp),
                no_dist=True,
            )
        state, summary = _summary(settings, src)
        atomic_write_json(tmp / TRAIN_STATE_FILE, state)
        atomic_write_json(tmp / SUMMARY_FILE, summary)
        atomic_write_json(
            tmp / COMMIT_FILE, {"step": 0, "dcp_dirs": ["."], "world_size": 1, "fingerprint": state["fingerprint"]}
        )
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        swap_in(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only the directory this call created
        raise
    n_params = sum(p.numel() for p in model.parameters())
    log.info("convert-mot: %s -> %s (%d tensors from the dense model)", src, dst, len(names))
    return ConvertResult(dst, len(names), n_params)
