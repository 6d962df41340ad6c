"""Presenting settings: `--explain KEY`, TOML rendering, and a torch-free parameter count."""

from __future__ import annotations

import typing

import tomli_w
from pydantic import BaseModel

from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.loader import ResolvedSettings, _section_class, suggest_key


def to_toml(settings: JobSettings) -> str:
    """The resolved settings as TOML (None values omitted: TOML has no null; they are defaults)."""
    table = _drop_none(settings.model_dump(mode="json"))
    assert isinstance(table, dict)  # a model's dump is a dict, and stays one
    return tomli_w.dumps(table)


def _drop_none(value: object) -> object:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _type_name(annotation: object) -> str:
    text = str(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "").replace("kforge_cli.settings.", "")


def explain_key(resolved: ResolvedSettings, key: str) -> str:
    """Description, type, default, current value and source of one key (or a section's keys)."""
    parts = key.split(".")
    model: type[BaseModel] = JobSettings
    value: object = resolved.settings
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            close = suggest_key(parts[: i + 1])
            hint = f"; did you mean {close}?" if close else ""
            raise InvalidInputError(f"unknown key {key!r}{hint}")
        value = getattr(value, part) if value is not None else None
        section = _section_class(info.annotation)
        last = i == len(parts) - 1
        if last:
            lines = [
                f"{key}: {info.description}",
                f"  type:    {_type_name(info.annotation)}",
            ]
            if section is not None and (value is None or isinstance(value, BaseModel)):
                lines.append(f"  source:  {resolved.source_of(key)}")
                lines.append("  keys:")
                for name, sub in section.model_fields.items():
                    current = getattr(value, name) if value is not None else sub.get_default(call_default_factory=True)
                    lines.append(f"    {key}.{name} = {current!r}  # {sub.description}")
                return "\n".join(lines)
            default = info.get_default(call_default_factory=True)
            lines += [
                f"  default: {default!r}",
                f"  value:   {value!r}",
                f"  source:  {resolved.source_of(key)}",
            ]
            return "\n".join(lines)
        if section is None:
            raise InvalidInputError(
                f"{'.'.join(parts[: i + 1])} is not a section; try --explain {'.'.join(parts[: i + 1])}"
            )
        model = section
    raise InvalidInputError(f"unknown key {key!r}")


def _linear(i: int, o: int) -> int:
    return i * o + o  # with bias


def vision_param_counts(s: JobSettings) -> dict[str, int | None]:
    """What a VLM adds to the text decoder, by part (empty for a text model).

    ``vision_encoder`` is None for ``type = 'hf'`` (its size is in the checkpoint, not the
    config). ``decoder`` is what the VLM architecture adds to the text layers: the extra
    per-modality experts of MoT, or the cross-attention sub-blocks.
    """
    enc, vlm = s.vision_encoder, s.vlm
    if vlm is None or enc is None:
        return {}
    parts: dict[str, int | None] = {}
    c = enc.dim
    if enc.type == "vit":
        block = 4 * c + _linear(c, 3 * c) + _linear(c, c) + _linear(c, 4 * c) + _linear(4 * c, c)
        parts["vision_encoder"] = (
            _linear(enc.channels * enc.patch_size**2, c) + enc.tokens_per_frame * c + enc.n_layers * block + 2 * c
        )
    else:
        parts["vision_encoder"] = None
    adapter = s.adapter
    d = s.model.dim
    if adapter is None or adapter.type == "mlp_2layer":
        hidden = (adapter.hidden_dim if adapter is not None else None) or d
        parts["adapter"] = _linear(c, hidden) + _linear(hidden, d)
    else:
        parts["adapter"] = _linear(c, d)
    m = s.model
    if vlm.arch == "mot":
        parts["decoder"] = (len(vlm.modalities) - 1) * m.n_layers * m.block_params()
    elif vlm.arch == "cross_attention":
        inner = m.n_heads * m.head_dim
        crossed = len(range(0, m.n_layers, vlm.cross_attention_every))
        parts["decoder"] = crossed * (d + 4 * d * inner)
    else:
        parts["decoder"] = 0
    return parts
