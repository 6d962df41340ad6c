"""The family registry: ``model.family`` -> :class:`~kforge_cli.engine.families.base.ModelFamily`.

kforge's own families are imported on first use (a job pays only for the one it trains). A
family from another package registers itself with one line in that package's ``pyproject.toml``::

    [project.entry-points."kforge.families"]
    myfamily = "mypackage.family:FAMILY"

(``FAMILY`` a :class:`ModelFamily` instance whose ``name`` is ``myfamily``), after which
``model.family = "myfamily"`` selects it; or, in-process (tests, notebooks), call
:func:`register_family`.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

from kforge_cli.engine.families.base import ModelFamily
from kforge_cli.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from kforge_cli.settings.training import ModelSettings

ENTRY_POINT_GROUP = "kforge.families"
DEFAULT_FAMILY = "llama"
"""``model.family``'s default: every run written before families existed is a Llama-family model."""

BUILTIN: dict[str, str] = {
    "llama": "kforge_cli.engine.families.llama:FAMILY",
    "gpt2": "kforge_cli.engine.families.gpt2:FAMILY",
    "deepseek_v3": "kforge_cli.engine.families.deepseek_v3.family:FAMILY",
    "gemma3": "kforge_cli.engine.families.gemma3:FAMILY",
}
"""kforge's own families: name -> ``module:attribute`` of the instance (imported lazily)."""

_REGISTERED: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make ``family`` selectable as ``model.family = family.name``; returns it (usable as a decorator's result)."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family expects a ModelFamily instance, got {type(family).__name__}")
    name = family.name
    known = _REGISTERED.get(name)
    if known is not None and known is not family and not replace:
        raise ValueError(f"a model family named {name!r} is already registered ({type(known).__qualname__})")
    _REGISTERED[name] = family
    return family


def _load(target: str, name: str) -> ModelFamily:
    module, _, attr = target.partition(":")
    family = getattr(importlib.import_module(module), attr)
    if not isinstance(family, ModelFamily) or family.name != name:
        raise TypeError(f"{target} is not a ModelFamily named {name!r}")
    return register_family(family)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def family_names() -> list[str]:
    """Every selectable family name: kforge's, registered ones and installed entry points."""
    return sorted(set(BUILTIN) | set(_REGISTERED) | set(_entry_points()))


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; a ConfigError (exit 2) naming ``model.family`` when there is none."""
    family = _REGISTERED.get(name)
    if family is not None:
        return family
    if name in BUILTIN:
        return _load(BUILTIN[name], name)
    ep = _entry_points().get(name)
    if ep is not None:
        family = ep.load()
        if not isinstance(family, ModelFamily):
            raise TypeError(f"entry point {ep.value} ({ENTRY_POINT_GROUP}) is not a ModelFamily instance")
        return register_family(family)
    known = ", ".join(family_names())
    raise ConfigError([ConfigIssue("model.family", f"unknown model family {name!r}; known: {known}")])


def family_for(cfg: ModelSettings) -> ModelFamily:
    """The family of a model's settings (``model.family``)."""
    return get_family(cfg.family)


def family_of(model: object) -> ModelFamily:
    """The family of a built model (or pipeline stage, or VLM around a text family): its ``cfg.family``."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise TypeError(f"{type(model).__name__} has no `cfg`: not a model built by a family")
    return family_for(cfg)


def family_for_hf(model_type: str) -> ModelFamily | None:
    """The family whose Hugging Face mapping imports ``config.json``'s ``model_type`` (None: no family)."""
    for name in family_names():
        family = get_family(name)
        if family.hf is not None and model_type in family.hf.model_types:
            return family
    return None


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "family_for",
    "family_for_hf",
    "family_names",
    "family_of",
    "get_family",
    "register_family",
]
