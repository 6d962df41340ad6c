"""Hugging Face weights into a kforge model: ``checkpoint.init_from = HF_DIR`` and ``load_model(HF_DIR)``.

Any family with a Hugging Face mapping (``ModelFamily.hf``), picked by ``config.json``'s
``model_type``; the Llama family's covers Llama, Qwen3 (dense with QK-norm) and its MoE architectures.

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

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.checkpoint.dcp_io import OPTIONS, _excluded
from kforge_cli.engine.families.base import ModelFamily
from kforge_cli.engine.families.registry import DEFAULT_FAMILY, family_for, family_for_hf, get_family
from kforge_cli.engine.interop.hf_format import hf_weight_files, read_hf_config
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
    "family",
    "mla",
)
_SOFT_FIELDS = ("rope_theta", "norm_eps")
_MOE_FIELDS = (
    "num_experts",
    "top_k",
    "num_shared_experts",
    "first_dense_layers",
    "every_n_layers",
    "score_func",
    "n_groups",
    "topk_groups",
    "renormalize",
    "route_scale",
)


def hf_model_settings(hf_dir: str | Path) -> ModelSettings:
    """The kforge :class:`ModelSettings` of a Hugging Face Llama directory; a config.json lacking or
    mangling a field is a CheckpointError naming the file and the field (exit 2), never a traceback."""
    path = Path(hf_dir).expanduser()
    config = read_hf_config(path)
    where = path / "config.json"
    family = _family_of(config)
    assert family.hf is not None
    try:
        fields = family.hf.model_fields(config)
        if family.name != DEFAULT_FAMILY:
            fields = {**fields, "family": family.name}
        return ModelSettings.model_validate(fields)
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
    ] + _moe_differences(cfg, theirs, hf_dir.name)
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
        if theirs.moe is not None:
            moe = theirs.moe.model_dump()
            moe["expert_hidden_dim"] = theirs.moe.resolved_expert_hidden_dim(theirs)
            overrides += "".join(
                f" --model.moe.{k}={str(moe[k]).lower() if isinstance(moe[k], bool) else moe[k]}"
                for k in ("expert_hidden_dim", *_MOE_FIELDS)
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


def _moe_differences(cfg: ModelSettings, theirs: ModelSettings, name: str) -> list[str]:
    """The MoE fields (router included: it decides what the weights compute) in which `cfg` and `theirs` differ."""
    if cfg.moe is None or theirs.moe is None:
        if (cfg.moe is None) != (theirs.moe is None):
            return [
                f"moe: run has {'none' if cfg.moe is None else 'MoE'}, {name} has {'none' if theirs.moe is None else 'MoE'}"
            ]
        return []
    ours_d, theirs_d = cfg.moe.model_dump(), theirs.moe.model_dump()
    ours_d["expert_hidden_dim"] = cfg.moe.resolved_expert_hidden_dim(cfg)
    theirs_d["expert_hidden_dim"] = theirs.moe.resolved_expert_hidden_dim(theirs)
    fields = ["expert_hidden_dim", *_MOE_FIELDS]
    if ours_d["n_groups"] == theirs_d["n_groups"] == 1:
        fields.remove("topk_groups")  # unused without groups
    return [f"moe.{f}: run has {ours_d[f]!r}, {name} has {theirs_d[f]!r}" for f in fields if ours_d[f] != theirs_d[f]]


def read_hf_tensors(hf_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """kforge name -> CPU tensor for every (or every wanted) weight in the directory's safetensors.

    The directory's ``config.json`` (read by the one bounded reader) names its ``model_type``; the
    family whose HF mapping imports it decodes the tensors (per-expert stacks, permutations).
    """
    hf_dir = Path(hf_dir).expanduser()
    config = read_hf_config(hf_dir)
    family = _family_of(config)
    wanted = set(names) if names is not None else None
    assert family.hf is not None
    return family.hf.read_tensors(config, hf_weight_files(hf_dir), wanted, hf_dir)


def _family_of(config: dict[str, object]) -> ModelFamily:
    """The family importing this HF config (the default one, whose mapping refuses it by name, when none does)."""
    family = family_for_hf(str(config.get("model_type")))
    return family if family is not None else get_family(DEFAULT_FAMILY)


def load_hf_weights(model: nn.Module, hf_dir: str | Path, cfg: ModelSettings, exclude: list[str]) -> list[str]:
    """Warm start from an HF Llama directory (FSDP/TP/PP models too): returns the parameter names loaded.

    Every rank reads the full tensors it needs (safetensors are memory-mapped) and
    ``set_model_state_dict(full_state_dict=True)`` keeps each rank's shard.
    """
    hf_dir = Path(hf_dir).expanduser().resolve()
    check_matches(cfg, hf_dir)
    local = get_model_state_dict(model, options=OPTIONS)
    mapping = family_for(cfg).hf
    prefixes = tuple(getattr(mapping, "fresh_on_import", ()))
    fresh = [k for k in local if prefixes and k.startswith(prefixes) and not _excluded(k, exclude)]
    if fresh:  # modules the Hugging Face class has no counterpart for (the family names them)
        log.warning(
            "warm start from %s: %d tensors (%s) have no counterpart in the Hugging Face model and keep their "
            "fresh initialisation",
            hf_dir,
            len(fresh),
            ", ".join(f"{p}*" for p in prefixes),
        )
    wanted = [k for k in local if not _excluded(k, exclude) and k not in fresh]
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
