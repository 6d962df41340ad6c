"""Hugging Face Llama weights into a kforge model: ``checkpoint.init_from = HF_DIR`` and ``load_model(HF_DIR)``.

Weights are read from safetensors only (never pickle). The HF config must describe
the same model the run builds: a shape difference is an error that spells out the
``--model.*`` overrides matching the HF model; a RoPE theta or norm epsilon difference
is allowed with a warning (changing them is a legitimate continued pre-training choice).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from kforge_cli.engine.checkpoint.dcp_io import OPTIONS, _excluded
from kforge_cli.engine.checkpoint.errors import CheckpointError
from kforge_cli.engine.interop.hf_format import from_hf_name, hf_weight_files, model_fields_from_hf, read_hf_config
from kforge_cli.engine.interop.hf_moe import FUSED_GATE, FUSED_UP, ROUTER_GATE, SKIPPED, from_hf_moe_name
from kforge_cli.settings.training import ModelSettings

log = logging.getLogger("kforge")

_SHAPE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "kv_heads",
    "vocab_size",
    "resolved_ffn_hidden_dim",
    "tie_embeddings",
    "norm",
    "activation",
    "qk_norm",
)
_SOFT_FIELDS = ("rope_theta", "norm_eps")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry; recomputed from the config


def hf_model_settings(hf_dir: str | Path) -> ModelSettings:
    """The kforge :class:`ModelSettings` of a Hugging Face Llama directory; a config.json lacking or
    mangling a field is a CheckpointError naming the file and the field (exit 2), never a traceback."""
    path = Path(hf_dir).expanduser()
    config = read_hf_config(path)
    where = path / "config.json"
    try:
        return ModelSettings.model_validate(model_fields_from_hf(config))
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # pydantic's ValidationError is a ValueError
        what = f"lacks the field {exc}" if isinstance(exc, KeyError) else f"has a field kforge cannot use ({exc})"
        raise CheckpointError(f"{where} {what}: a Llama or Qwen3-MoE config.json is expected") from None


def check_matches(cfg: ModelSettings, hf_dir: Path) -> None:
    """Refuse an HF model of another shape than `cfg`; warn about RoPE theta / norm eps differences."""
    theirs = hf_model_settings(hf_dir)
    wrong = [
        f"{f}: run has {getattr(cfg, f)!r}, {hf_dir.name} has {getattr(theirs, f)!r}"
        for f in _SHAPE_FIELDS
        if getattr(cfg, f) != getattr(theirs, f)
    ]
    if wrong:
        overrides = " ".join(
            f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in theirs.model_dump().items()
            if k
            in (
                "dim",
                "n_layers",
                "n_heads",
                "n_kv_heads",
                "vocab_size",
                "ffn_hidden_dim",
                "tie_embeddings",
                "max_seq_len",
                "rope_theta",
                "norm_eps",
            )
        )
        raise CheckpointError(
            f"checkpoint.init_from={hf_dir} is a differently shaped model ({'; '.join(wrong)}). "
            f"To continue pre-training it, build the same model: {overrides}"
        )
    for f in _SOFT_FIELDS:
        if getattr(cfg, f) != getattr(theirs, f):
            log.warning(
                "warm start from %s: model.%s is %r here but %r there (the function changes)",
                hf_dir,
                f,
                getattr(cfg, f),
                getattr(theirs, f),
            )


def read_hf_tensors(hf_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """kforge name -> CPU tensor for every (or every wanted) Llama weight in the directory's safetensors."""
    from safetensors import SafetensorError, safe_open

    hf_dir = Path(hf_dir).expanduser()
    wanted = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for path in hf_weight_files(hf_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    name = from_hf_name(key) or from_hf_moe_name(key)
                    if name is not None and name.endswith(FUSED_GATE):  # Qwen3-MoE's fused gate/up
                        gate, up = f.get_tensor(key).chunk(2, dim=1)
                        up_name = name.removesuffix(FUSED_GATE) + FUSED_UP
                        for part_name, part in ((name, gate), (up_name, up)):
                            if wanted is None or part_name in wanted:
                                out[part_name] = part.contiguous()
                        continue
                    if name is None:
                        if not key.endswith(_IGNORED_SUFFIXES):
                            unknown.append(key)
                    elif wanted is None or name in wanted:
                        out[name] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    for name in [n for n in out if n.endswith(ROUTER_GATE)]:  # Qwen3-MoE has no selection bias: zero
        bias = name.removesuffix(ROUTER_GATE) + SKIPPED
        if wanted is None or bias in wanted:
            out[bias] = torch.zeros(out[name].shape[0], dtype=torch.float32)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise CheckpointError(f"{hf_dir} holds tensors a kforge Llama has no place for: {shown}")
    return out


def load_hf_weights(model: nn.Module, hf_dir: str | Path, cfg: ModelSettings, exclude: list[str]) -> list[str]:
    """Warm start from an HF Llama directory (FSDP/TP/PP models too): returns the parameter names loaded.

    Every rank reads the full tensors it needs (safetensors are memory-mapped) and
    ``set_model_state_dict(full_state_dict=True)`` keeps each rank's shard.
    """
    hf_dir = Path(hf_dir).expanduser().resolve()
    check_matches(cfg, hf_dir)
    local = get_model_state_dict(model, options=OPTIONS)
    wanted = [k for k in local if not _excluded(k, exclude)]
    tensors = read_hf_tensors(hf_dir, wanted)
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(
            f"{hf_dir} has no weights for {shown}; list them in checkpoint.exclude_from_loading to keep their "
            "fresh initialisation"
        )
    full: dict[str, Any] = {}
    for name in wanted:
        target = local[name]
        assert isinstance(target, torch.Tensor)  # model state dicts hold tensors (DTensors when sharded)
        if tuple(tensors[name].shape) != tuple(target.shape):
            raise CheckpointError(
                f"{hf_dir}: {name} is {tuple(tensors[name].shape)}, the model wants {tuple(target.shape)}"
            )
        full[name] = tensors.pop(name).to(target.dtype)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    return sorted(wanted)
