"""Presenting settings: `--explain KEY`, TOML rendering, and a torch-free parameter count."""

from __future__ import annotations

import types
import typing

import tomli_w
from pydantic import BaseModel

from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.config_layers import ResolvedSettings, _section_class, suggest_key
from kforge_cli.settings.job import JobSettings


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
    """The type as a user reads it: ``tuple[float, float], each in [0, 1)``, not pydantic's internals."""
    text, bound = _render(annotation)
    if not bound:
        return text
    return f"{text} in {bound}" if text.endswith(", each") else f"{text}, in {bound}"


def _bound(metadata: typing.Iterable[object]) -> str | None:
    """``[0, 1)`` from annotated-types' Ge/Gt/Le/Lt (those of a FieldInfo too); ``>= 0`` with one side."""
    low = high = None
    for item in metadata:
        for inner in [item, *getattr(item, "metadata", [])]:
            for name, side, bracket in (
                ("ge", "low", "["),
                ("gt", "low", "("),
                ("le", "high", "]"),
                ("lt", "high", ")"),
            ):
                value = getattr(inner, name, None)
                if value is not None and side == "low":
                    low = (bracket, value)
                elif value is not None:
                    high = (bracket, value)
    if low and high:
        return f"{low[0]}{low[1]}, {high[1]}{high[0]}"
    if low or high:
        (bracket, value), op = (low, ">=" if low[0] == "[" else ">") if low else (high, "<=" if high[0] == "]" else "<")  # type: ignore[misc]
        return f"{op} {value}"
    return None


def _render(annotation: object) -> tuple[str, str | None]:
    """(the type's text, the bound its values share, if any)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        text, _ = _render(args[0])
        return text, _bound(args[1:])
    if origin is None:
        name = getattr(annotation, "__name__", None) or str(annotation)
        return name.replace("typing.", "").replace("kforge_cli.settings.", "").replace("NoneType", "None"), None
    parts = [_render(a) if a is not Ellipsis else ("...", None) for a in args]
    bounds = {b for _, b in parts}
    inner = ", ".join(text for text, _ in parts)
    if origin in (typing.Union, types.UnionType):
        text = " | ".join(t for t, _ in parts)
    else:
        text = f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if len(bounds) == 1 and None not in bounds and len(parts) > 1:
        return f"{text}, each", bounds.pop()
    return text, bounds.pop() if len(bounds) == 1 else None


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
