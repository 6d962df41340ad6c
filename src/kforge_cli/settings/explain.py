"""Presenting settings: `--explain KEY`, TOML rendering, and a torch-free parameter count."""

from __future__ import annotations

import typing
from typing import Any

import tomli_w
from pydantic import BaseModel

from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.loader import ResolvedSettings, _section_class, all_keys


def to_toml(settings: JobSettings) -> str:
    """The resolved settings as TOML (None values omitted: TOML has no null; they are defaults)."""
    return tomli_w.dumps(_drop_none(settings.model_dump(mode="json")))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _type_name(annotation: Any) -> str:
    text = str(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "").replace("kforge_cli.settings.", "")


def explain_key(resolved: ResolvedSettings, key: str) -> str:
    """Description, type, default, current value and source of one key (or a section's keys)."""
    parts = key.split(".")
    model: type[BaseModel] = JobSettings
    value: Any = resolved.settings
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            import difflib

            close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
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
