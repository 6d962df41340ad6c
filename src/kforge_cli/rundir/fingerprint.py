"""The model-shaping part of a configuration, and its fingerprint.

A checkpoint can only continue a run whose model has the same parameters and computes
the same function, so a resume compares these fields (by a SHA-256 of them, with the
fields themselves kept to name what changed). Everything else (steps, LR, data,
parallelism, checkpoint cadence) may change on resume. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kforge_cli.settings import JobSettings

# Fields that change parameters or the function the model computes. `model.init_std`
# only matters at step 0, and `model.attention` picks a kernel for the same function, so
# both may differ on resume.
_MODEL_EXCLUDED = frozenset({"init_std", "attention", "mtp_loss_weight"})
# `model.family` shapes the model, but runs written before families existed are all Llama: the
# default family is left out, so their fingerprints (and resumes) stay what they were.
_DEFAULT_FAMILY = "llama"
# Likewise the DeepSeek-V3 and Gemma 3 fields at their defaults (no latent attention, no MTP modules, no
# local/global layout): runs written before those families resume.
_ABSENT_DEFAULTS = {"family": _DEFAULT_FAMILY, "mla": None, "mtp_depth": 0, "gemma3": None}
_VLM_SHAPING = ("arch", "cross_attention_every", "modalities")


def shaping_config(settings: JobSettings) -> dict[str, object]:
    """Dotted key -> JSON value of every model-shaping field (absent VLM sections are None)."""
    out: dict[str, object] = {}
    for name, value in settings.model.model_dump(mode="json").items():
        if name not in _MODEL_EXCLUDED and not (name in _ABSENT_DEFAULTS and value == _ABSENT_DEFAULTS[name]):
            out[f"model.{name}"] = value
    for section in ("vision_encoder", "adapter"):
        sub = getattr(settings, section)
        if sub is None:
            out[section] = None
            continue
        for name, value in sub.model_dump(mode="json").items():
            out[f"{section}.{name}"] = value
    if settings.vlm is None:
        out["vlm"] = None
    else:
        for name in _VLM_SHAPING:
            out[f"vlm.{name}"] = getattr(settings.vlm, name)
    return out


def fingerprint(shaping: dict[str, object]) -> str:
    """SHA-256 of the canonical JSON of a shaping config."""
    blob = json.dumps(shaping, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def shaping_diff(old: dict[str, object], new: dict[str, object]) -> list[tuple[str, object, object]]:
    """(key, old value, new value) for every shaping field that differs (sorted by key)."""
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def changed_fields(old: dict[str, object], new: dict[str, object]) -> list[str]:
    """`key: old -> new` for every shaping field that differs (sorted by key)."""
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in shaping_diff(old, new)]
