"""`load_model(CKPT)`: a checkpoint as a ready-to-call model, for notebooks and evaluation harnesses.

    from kforge_cli import load_model
    model = load_model("runs/x/checkpoints/step_1000")   # or the run dir, or an HF Llama dir
    logits = model(tokens)                                # [B, T, vocab]

No GPU and no process group: the weights are reassembled from however many shards,
ranks and pipeline stages wrote them (see ``reader``). The model is built on the meta
device and materialised empty, so loading costs no random initialisation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kforge_cli.engine.checkpoint.errors import CheckpointError
from kforge_cli.engine.checkpoint.hf_format import is_hf_dir
from kforge_cli.engine.checkpoint.reader import (
    MODEL_PREFIX,
    CheckpointView,
    is_vlm,
    iter_tensors,
    model_settings_of,
    open_checkpoint,
)
from kforge_cli.engine.model import Transformer
from kforge_cli.engine.model.layers import rope_tables
from kforge_cli.settings.core import ModelSettings


def empty_model(
    cfg: ModelSettings, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """A Transformer with uninitialised weights in `dtype` and fp32 RoPE tables on `device`."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype)  # on meta: free; RoPE tables are recomputed in fp32 below
    model.to_empty(device=device)
    model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device)
    return model


def _fill_from_checkpoint(model: Transformer, view: CheckpointView) -> None:
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


def load_model(
    checkpoint: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_settings: ModelSettings | None = None,
) -> Transformer:
    """The model stored in `checkpoint`, in eval mode, with weights in `dtype` on `device` (default CPU).

    `checkpoint` is a kforge step dir, a run dir or checkpoints dir (its newest complete
    checkpoint), any DCP directory holding ``model.*`` tensors (then pass
    `model_settings`), or a Hugging Face Llama directory. ``model(tokens)`` returns logits.
    """
    if is_hf_dir(checkpoint):
        from kforge_cli.engine.checkpoint.hf_import import hf_model_settings, read_hf_tensors

        cfg = model_settings or hf_model_settings(checkpoint)
        model = empty_model(cfg, dtype, device)
        params = model.state_dict()
        tensors = read_hf_tensors(checkpoint, params)
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise CheckpointError(f"{checkpoint} has no weights for {', '.join(missing[:8])}")
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
        return model.eval()
    view = open_checkpoint(checkpoint)
    if not view.complete:
        raise CheckpointError(
            f"{view.path} is an incomplete checkpoint (its save never finished); use an earlier step_N or the run dir"
        )
    if model_settings is None and is_vlm(view):
        raise CheckpointError(
            f"{view.path} holds a vision-language model; load_model builds text Transformers only in this version"
        )
    cfg = model_settings or model_settings_of(view)
    model = empty_model(cfg, dtype, device)
    _fill_from_checkpoint(model, view)
    return model.eval()
