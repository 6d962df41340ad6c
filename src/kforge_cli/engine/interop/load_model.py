"""`load_model(CKPT)`: a checkpoint as a ready-to-call model, for notebooks and evaluation harnesses.

    from kforge_cli import load_model
    model = load_model("runs/x/checkpoints/step_1000")   # or the run dir, or an HF Llama dir
    logits = model(tokens)                                # [B, T, vocab]
    logits = model(tokens, pixel_values=pixels)           # a vision-language (or MoT) checkpoint

No GPU and no process group: the weights are reassembled from however many shards,
ranks and pipeline stages wrote them (see ``reader``). The model is built on the meta
device and materialised empty, so loading costs no random initialisation. A checkpoint
whose saved config has a ``vlm`` section (joint decoder, cross-attention or
Mixture-of-Transformers, including a ``convert-mot`` output) becomes the
:class:`VisionLanguageModel` of that config; everything else the text model of its family (``model.family``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.checkpoint.reader import (
    MODEL_PREFIX,
    CheckpointView,
    is_vlm,
    iter_tensors,
    model_settings_of,
    open_checkpoint,
    shaping_of,
)
from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.model.moe import MoEFeedForward
from kforge_cli.engine.model.vlm import VisionLanguageModel, build_vlm
from kforge_cli.rundir.checkpoints import is_hf_dir
from kforge_cli.rundir.saved_config import read_saved_config
from kforge_cli.settings import JobSettings
from kforge_cli.settings.training import ModelSettings

LoadedModel = nn.Module  # the text family's model, or a VisionLanguageModel
_VLM_SECTIONS = ("model", "vision_encoder", "adapter", "vlm")


def _materialise(model: nn.Module, cfg: ModelSettings, dtype: torch.dtype, device: str | torch.device) -> None:
    """Meta -> uninitialised storage in `dtype` on `device`, then recompute the buffers no checkpoint holds.

    Non-persistent buffers are not saved, so after ``to_empty`` they hold garbage: the
    RoPE tables are recomputed in fp32 and position-id buffers (Hugging Face vision
    towers) refilled with their ``arange``. Any other such buffer would be silently wrong,
    so it is an error rather than a guess.
    """
    model.to(dtype)  # on meta: free; the family recomputes its buffers (RoPE tables in fp32) below
    model.to_empty(device=device)
    rebuilt = family_for(cfg).reset_buffers(model, device)
    unknown: list[str] = []
    for module_name, module in model.named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", set())):
            full = f"{module_name}.{name}" if module_name else name
            buf = module._buffers.get(name)
            if buf is None or full in rebuilt:
                continue
            if isinstance(module, MoEFeedForward):
                with torch.no_grad():
                    module.reset_step_stats()
            elif name.endswith("position_ids"):
                with torch.no_grad():
                    buf.copy_(torch.arange(buf.shape[-1], device=buf.device).expand_as(buf))
            else:
                unknown.append(full)
    if unknown:
        raise CheckpointError(
            f"load_model cannot rebuild the unsaved buffers {unknown[:5]} of this model; "
            "build it with its own constructor and load the weights with engine.checkpoint.load_model_weights"
        )


def empty_model(
    cfg: ModelSettings, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """The model of ``cfg``'s family with uninitialised weights in `dtype` and its buffers (fp32 RoPE tables) on `device`."""
    model = family_for(cfg).meta_model(cfg)
    _materialise(model, cfg, dtype, device)
    return model


def empty_vlm(
    settings: JobSettings, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> VisionLanguageModel:
    """The VLM of `settings` with uninitialised weights in `dtype` and fp32 RoPE tables on `device`."""
    with torch.device("meta"):
        model = build_vlm(settings)
    _materialise(model, settings.model, dtype, device)
    return model


def _saved_run_config(view: CheckpointView) -> dict[str, object]:
    """RUN_DIR/config.toml of a step dir inside RUN_DIR/checkpoints, or {} (absent, unreadable, elsewhere)."""
    return read_saved_config(view.path.parent.parent, missing_ok=True) if view.kforge else {}


def _video_section(vlm: dict[str, Any], saved: dict[str, object]) -> dict[str, object] | None:
    """The ``[video]`` section, which only decides which MoT expert visual tokens use.

    It is not part of the checkpoint's shaping record, so it comes from the run's
    config.toml when there is one; failing that, a MoT model with a ``video`` but no
    ``image`` modality can only have been a video job.
    """
    modalities = vlm.get("modalities") or []
    if vlm.get("arch") != "mot" or "video" not in modalities:
        return None
    video = saved.get("video")
    if isinstance(video, dict):
        return dict(video)
    return {} if "image" not in modalities else None


def vlm_settings_of(view: CheckpointView) -> JobSettings:
    """The :class:`JobSettings` sections that shape the VLM of a kforge checkpoint (the rest at defaults)."""
    shaping = shaping_of(view)
    saved = _saved_run_config(view)
    sections: dict[str, Any] = {}
    for name in _VLM_SECTIONS:
        prefix = f"{name}."
        fields = {k.removeprefix(prefix): v for k, v in shaping.items() if k.startswith(prefix)}
        if name == "model":
            fields.pop("init_std", None)  # not recorded by training; only matters at step 0
        if fields:
            sections[name] = fields
        elif isinstance(shaping.get(name), dict):
            sections[name] = shaping[name]
        elif name not in shaping and isinstance(saved.get(name), dict):  # shaping read from config.toml
            sections[name] = saved[name]
    if "vlm" not in sections or "vision_encoder" not in sections:
        raise CheckpointError(
            f"{view.path} holds a vision-language model but its saved config lacks the [vlm] or [vision_encoder] "
            "section: pass the job settings, load_model(path, model_settings=JobSettings(...))"
        )
    video = _video_section(sections["vlm"], saved)
    if video is not None:
        sections["video"] = video
    try:
        return JobSettings.model_validate(sections)  # model_validate: no environment variables read
    except Exception as exc:  # a checkpoint from another kforge version with other fields
        raise CheckpointError(f"{view.path}: its VLM config does not fit this kforge version ({exc})") from None


ROPE_FLOOR_BYTES = 64 * 2**20  # RoPE tables may always take this much, whatever the weights


def check_claims(model: nn.Module, cfg: ModelSettings, stored: dict[str, tuple[int, ...]], where: str | Path) -> None:
    """Before any storage is allocated: the meta-device `model` (built from a config a file claims) must
    have exactly the parameters `stored` holds, shape for shape, and its RoPE tables must be bounded by
    the stored weights.

    A checkpoint's shaping record or an HF ``config.json`` could claim ``vocab_size = 1e9`` or
    ``max_seq_len = 2**23``: allocating first and checking after would take GBs (or crash the
    allocator) for a file of a few MB. RoPE tables are the one allocation no stored tensor
    backs: ``8 * max_seq_len * head_dim`` bytes may not exceed the weights' fp32 size (a 64 MiB
    floor keeps every honest small model).
    """
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if ours.keys() != stored.keys():
        lacking, extra = sorted(ours.keys() - stored.keys()), sorted(stored.keys() - ours.keys())
        raise CheckpointError(
            f"{where} does not match the model its config describes: missing {lacking[:5]}, unexpected {extra[:5]}"
        )
    for name in sorted(ours):
        if ours[name] != tuple(stored[name]):
            raise CheckpointError(
                f"{where}: {name} is stored as {tuple(stored[name])}, but the config describes {ours[name]} "
                "(model settings and weights disagree; nothing was loaded)"
            )
    weights = sum(4 * math.prod(shape) for shape in stored.values())
    rope = 8 * int(cfg.max_seq_len) * int(cfg.rope_dim)
    if rope > max(weights, ROPE_FLOOR_BYTES):
        raise CheckpointError(
            f"{where}: max_seq_len={cfg.max_seq_len} would need {rope / 2**20:.0f} MiB of RoPE tables for "
            f"{weights / 2**20:.1f} MiB of weights: not a config these weights were trained with. Pass the model "
            "settings explicitly (load_model(path, model_settings=...)) if it really is"
        )


class _Layered(Protocol):
    """Settings of a stack of layers (the text model's or the vision encoder's)."""

    @property
    def n_layers(self) -> int: ...


def refuse_layer_count(cfg: _Layered | None, stored_tensors: int, where: str | Path, what: str = "n_layers") -> None:
    """A claimed ``n_layers`` beyond the number of stored tensors (each layer holds several) is refused
    before even a meta-device model is built layer by layer."""
    if cfg is not None and int(cfg.n_layers) > stored_tensors:
        raise CheckpointError(
            f"{where}: its config claims {what}={cfg.n_layers}, but only {stored_tensors} tensors are stored"
        )


def _fill_from_checkpoint(model: nn.Module, view: CheckpointView) -> None:
    params = model.state_dict()  # tensors sharing the parameters' storage
    ours = {MODEL_PREFIX + k for k in params}
    theirs = {e.key for e in view.model_entries()}
    if ours != theirs:
        lacking = sorted(k.removeprefix(MODEL_PREFIX) for k in ours - theirs)
        extra = sorted(k.removeprefix(MODEL_PREFIX) for k in theirs - ours)
        raise CheckpointError(
            f"{view.path} does not match the model its config describes: missing {lacking[:5]}, unexpected {extra[:5]}"
        )
    for key in sorted(ours):
        entry, target = view.tensors[key], params[key.removeprefix(MODEL_PREFIX)]
        if tuple(entry.shape) != tuple(target.shape):
            raise CheckpointError(f"{view.path}: {entry.key} is {entry.shape}, the model wants {tuple(target.shape)}")
    with torch.no_grad():
        for key, tensor in iter_tensors(view, sorted(ours)):
            params[key.removeprefix(MODEL_PREFIX)].copy_(tensor)


def _load_hf(
    checkpoint: str | Path, cfg: ModelSettings | None, dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    from kforge_cli.engine.interop.hf_import import hf_model_settings, read_hf_tensors

    cfg = cfg or hf_model_settings(checkpoint)
    tensors = read_hf_tensors(checkpoint)  # memory-mapped: bounded by the files, not by config.json
    refuse_layer_count(cfg, len(tensors), checkpoint)
    model = family_for(cfg).meta_model(cfg)
    wanted = set(model.state_dict())
    missing = sorted(wanted - set(tensors))
    if missing:
        raise CheckpointError(f"{checkpoint} has no weights for {', '.join(missing[:8])}")
    tensors = {name: t for name, t in tensors.items() if name in wanted}
    check_claims(model, cfg, {name: tuple(t.shape) for name, t in tensors.items()}, checkpoint)  # exact shapes
    _materialise(model, cfg, dtype, device)
    params = model.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)  # shapes equal (checked): never a broadcast
    return model.eval()


def load_model(
    checkpoint: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_settings: ModelSettings | JobSettings | None = None,
) -> LoadedModel:
    """The model stored in `checkpoint`, in eval mode, with weights in `dtype` on `device` (default CPU).

    `checkpoint` is a kforge step dir, a run dir or checkpoints dir (its newest complete
    checkpoint), any DCP directory holding ``model.*`` tensors (then pass
    `model_settings`: a :class:`ModelSettings` for a text model, a :class:`JobSettings`
    with ``vlm`` set for a vision-language one), or a Hugging Face Llama directory.
    ``model(tokens)`` returns logits; a VLM also takes ``pixel_values`` (and ``frame_mask``).
    """
    job: JobSettings | None = None
    cfg: ModelSettings | None = None
    if isinstance(model_settings, JobSettings):
        job, cfg = model_settings, model_settings.model
    else:
        cfg = model_settings
    if is_hf_dir(checkpoint):
        return _load_hf(checkpoint, cfg, dtype, device)
    view = open_checkpoint(checkpoint)
    if not view.complete:
        raise CheckpointError(
            f"{view.path} is an incomplete checkpoint (its save never finished); use an earlier step_N or the run dir"
        )
    stored = {e.key.removeprefix(MODEL_PREFIX): tuple(e.shape) for e in view.model_entries()}
    vlm_job = job if job is not None and job.vlm is not None else None
    if vlm_job is None and cfg is None and is_vlm(view):
        vlm_job = vlm_settings_of(view)
    text_cfg = vlm_job.model if vlm_job is not None else cfg or model_settings_of(view)
    refuse_layer_count(text_cfg, len(stored), view.path)
    if vlm_job is not None:
        refuse_layer_count(vlm_job.vision_encoder, len(stored), view.path, "vision_encoder.n_layers")
    with torch.device("meta"):
        model: LoadedModel = build_vlm(vlm_job) if vlm_job is not None else family_for(text_cfg).build(text_cfg)
    check_claims(model, text_cfg, stored, view.path)  # before a byte is allocated
    _materialise(model, text_cfg, dtype, device)
    _fill_from_checkpoint(model, view)
    return model.eval()
