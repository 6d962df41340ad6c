"""Hugging Face weights into a kforge model: ``checkpoint.init_from = HF_DIR`` and ``load_model(HF_DIR)``.

Llama, Qwen3 (dense with QK-norm), and the MoE architectures of ``hf_moe``.

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
from kforge_cli.engine.interop.hf_layout import from_interleaved_rope
from kforge_cli.engine.interop.hf_moe import BY_MODEL_TYPE, EXPERT_BIAS, ROUTER_GATE, from_hf_moe_name
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
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry; recomputed from the config
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
FUSED_GATE = "feed_forward.experts.w1"
FUSED_UP = "feed_forward.experts.w3"


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

    Llama / Qwen3 names map one to one; MoE experts written per expert are stacked into
    kforge's ``[E, out, in]`` (a fused ``gate_up_proj`` is split), the selection bias is
    read from wherever the architecture keeps it (zeros for Qwen3-MoE, which has none),
    and ERNIE's interleaved-RoPE ``q_proj``/``k_proj`` rows are put back in kforge's order.
    """
    from safetensors import SafetensorError, safe_open

    hf_dir = Path(hf_dir).expanduser()
    config = read_hf_config(hf_dir)
    if config.get("model_type") == "deepseek_v3":
        return _read_deepseek_v3(hf_dir, config, names)
    arch = BY_MODEL_TYPE.get(str(config.get("model_type")))
    wanted = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    unknown: list[str] = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        if wanted is None or name in wanted:
            out[name] = tensor

    for path in hf_weight_files(hf_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    plain = from_hf_name(key)
                    moe = None if plain is not None else from_hf_moe_name(key)
                    if plain is not None:
                        keep(plain, f.get_tensor(key))
                    elif moe is None:
                        if not key.endswith(_IGNORED_SUFFIXES):
                            unknown.append(key)
                    elif moe.fused:  # gate_up_proj [E, 2 x hidden, dim]: w1 over w3
                        gate, up = f.get_tensor(key).chunk(2, dim=1)
                        keep(moe.name, gate.contiguous())
                        keep(moe.name.removesuffix(FUSED_GATE) + FUSED_UP, up.contiguous())
                    elif moe.expert is not None:
                        if wanted is None or moe.name in wanted:
                            experts.setdefault(moe.name, {})[moe.expert] = f.get_tensor(key)
                    elif moe.name.endswith(EXPERT_BIAS):
                        keep(moe.name, f.get_tensor(key).reshape(-1).float())
                    else:
                        keep(moe.name, f.get_tensor(key))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    for name, parts in experts.items():
        if sorted(parts) != list(range(len(parts))):
            raise CheckpointError(f"{hf_dir}: the experts of {name} are not numbered 0..{len(parts) - 1}")
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    for name in [n for n in out if n.endswith(ROUTER_GATE)]:  # an architecture without a selection bias: zero
        bias = name.removesuffix(ROUTER_GATE) + EXPERT_BIAS
        if bias not in out and (wanted is None or bias in wanted):
            out[bias] = torch.zeros(out[name].shape[0], dtype=torch.float32)
    if arch is not None and arch.interleaved_rope:
        n_heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or n_heads)
        for name in out:
            if name.endswith("attention.wq.weight"):
                out[name] = from_interleaved_rope(out[name], n_heads)
            elif name.endswith("attention.wk.weight"):
                out[name] = from_interleaved_rope(out[name], kv_heads)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise CheckpointError(f"{hf_dir} holds tensors a kforge model has no place for: {shown}")
    return out


def _read_deepseek_v3(hf_dir: Path, config: dict[str, Any], names: Iterable[str] | None) -> dict[str, torch.Tensor]:
    """:func:`read_hf_tensors` of a ``DeepseekV3ForCausalLM`` directory (the family's mapping)."""
    from safetensors import SafetensorError, safe_open

    from kforge_cli.engine.families.deepseek_v3.hf import from_hf_tensors

    raw: dict[str, torch.Tensor] = {}
    for path in hf_weight_files(hf_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if not key.endswith(_IGNORED_SUFFIXES):
                        raw[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    try:
        out, skipped = from_hf_tensors(raw, config)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{hf_dir}: cannot map its DeepseekV3 tensors ({exc})") from None
    n_layers = int(config.get("num_hidden_layers", 0))
    unknown = [k for k in skipped if not _beyond_layers(k, n_layers)]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise CheckpointError(f"{hf_dir} holds tensors a kforge model has no place for: {shown}")
    if skipped:
        log.warning(
            "%s: %d tensors of layers past num_hidden_layers (DeepSeek's MTP layers) not read", hf_dir, len(skipped)
        )
    wanted = set(names) if names is not None else None
    return {k: v for k, v in out.items() if wanted is None or k in wanted}


def _beyond_layers(name: str, n_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n_layers


def load_hf_weights(model: nn.Module, hf_dir: str | Path, cfg: ModelSettings, exclude: list[str]) -> list[str]:
    """Warm start from an HF Llama directory (FSDP/TP/PP models too): returns the parameter names loaded.

    Every rank reads the full tensors it needs (safetensors are memory-mapped) and
    ``set_model_state_dict(full_state_dict=True)`` keeps each rank's shard.
    """
    hf_dir = Path(hf_dir).expanduser().resolve()
    check_matches(cfg, hf_dir)
    local = get_model_state_dict(model, options=OPTIONS)
    fresh = [k for k in local if k.startswith("mtp.") and not _excluded(k, exclude)]
    if fresh:  # DeepSeek-V3's multi-token-prediction modules: transformers has no counterpart
        log.warning(
            "warm start from %s: the %d tensors of the multi-token-prediction modules (mtp.*) have no "
            "counterpart in transformers and keep their fresh initialisation",
            hf_dir,
            len(fresh),
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
