"""Freezing parts of a VLM by alias or pattern, per step, without ever removing them from training.

A *spec* is a module alias or a parameter-name pattern:

    vision (= vision_encoder, encoder)   the image encoder           vision.*
    adapter                               the connector               adapter.*
    language_model (= llm)                the whole text model        tok_embeddings, layers, norm, output
    embeddings / head                     token embedding / output head (+ final norm)
    cross_attention                       the cross-attention sub-blocks (arch cross_attention)
    experts.<modality>                    one modality's MoT weights  layers.*.experts.<modality>.*
    anything else                         an fnmatch pattern or a module prefix of parameter names,
                                          e.g. "layers.0" or "layers.*.feed_forward.*"

The freeze in force for the update that follows ``step`` completed optimizer steps is
``vlm.freeze`` plus the last ``vlm.freeze_schedule`` stage with ``start_step <= step``.
So a stage starting at ``S`` changes updates ``S+1, S+2, ...``: the checkpoint of step
``S`` still has the old stage's weights, and a resume at step ``S`` applies the new one.

Frozen parameters keep ``requires_grad`` and their place in the optimizer (and in FSDP's
shards); the step function drops their gradients after the backward, so the optimizer
skips them and the gradient norm ignores them. Unfreezing at step S needs no rebuild and
no re-sharding.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from kforge_cli.common.json_values import dict_of, int_of, list_of
from kforge_cli.engine.model.module_names import clean_param_name
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.vlm import VLMSettings

ALIASES: dict[str, tuple[str, ...]] = {
    "vision": ("vision",),
    "vision_encoder": ("vision",),
    "encoder": ("vision",),
    "adapter": ("adapter",),
    "language_model": ("tok_embeddings", "layers", "norm", "output"),
    "llm": ("tok_embeddings", "layers", "norm", "output"),
    "embeddings": ("tok_embeddings",),
    "head": ("output", "norm"),
    "cross_attention": ("layers.*.cross_attention", "layers.*.cross_attention_norm"),
}


def spec_patterns(spec: str) -> tuple[str, ...]:
    """Module prefixes / fnmatch patterns a spec stands for."""
    if spec in ALIASES:
        return ALIASES[spec]
    if spec.startswith("experts."):
        return (f"layers.*.{spec}",)
    return (spec,)


def matches(name: str, spec: str) -> bool:
    """True when parameter ``name`` belongs to ``spec`` (a module prefix or a glob, or a glob of modules)."""
    for pattern in spec_patterns(spec):
        if name == pattern or name.startswith(pattern + "."):
            return True
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*"):
            return True
    return False


def stages_of(freeze: Sequence[str], schedule: Iterable[Mapping[str, object]]) -> list[tuple[int, tuple[str, ...]]]:
    """(start step, sorted specs frozen from then on) for a plain freeze list and schedule stages."""
    base = set(freeze)
    out = [(0, tuple(sorted(base)))]
    for stage in sorted(schedule, key=lambda s: int_of(s["start_step"])):
        start = int_of(stage["start_step"])
        specs = tuple(sorted(base | set(_specs(stage.get("freeze", [])))))
        out = [s for s in out if s[0] != start] + [(start, specs)]
    return out


def _specs(value: object) -> list[str]:
    """A freeze list as a checkpoint recorded it (JSON): a list of spec strings."""
    specs = list_of(value, "freeze")
    if not all(isinstance(s, str) for s in specs):
        raise TypeError(f"freeze is {value!r}, not a list of names")
    return [str(s) for s in specs]


def _config_stages(cfg: VLMSettings | Mapping[str, object] | None) -> list[tuple[int, tuple[str, ...]]]:
    if cfg is None:
        return [(0, ())]
    if isinstance(cfg, VLMSettings):
        return stages_of(cfg.freeze, [s.model_dump() for s in cfg.freeze_schedule])
    schedule = [
        dict_of(s, "a freeze_schedule stage") for s in list_of(cfg.get("freeze_schedule", []), "freeze_schedule")
    ]
    return stages_of(_specs(cfg.get("freeze", [])), schedule)


def frozen_specs_at(cfg: VLMSettings | Mapping[str, object] | None, step: int) -> tuple[str, ...]:
    """Specs frozen for the update after ``step`` completed steps (see the module docstring)."""
    current: tuple[str, ...] = ()
    for start, specs in _config_stages(cfg):
        if start <= step:
            current = specs
    return current


def all_specs(cfg: VLMSettings) -> list[tuple[str, str]]:
    """(settings field, spec) of every spec the config names, to check each matches something."""
    out = [("vlm.freeze", s) for s in cfg.freeze]
    for i, stage in enumerate(cfg.freeze_schedule):
        out += [(f"vlm.freeze_schedule.{i}.freeze", s) for s in stage.freeze]
    return out


def check_specs(cfg: VLMSettings, names: Iterable[str]) -> None:
    """Every spec must match at least one parameter: a typo must not silently train everything."""
    names = [clean_param_name(n) for n in names]
    for where, spec in all_specs(cfg):
        if not any(matches(n, spec) for n in names):
            raise InvalidInputError(
                f"{where}: {spec!r} matches no parameter of this model; use an alias "
                f"({', '.join(sorted(ALIASES))}, experts.<modality>) or a name pattern such as 'layers.0' or "
                "'vision.layers.*'"
            )


def frozen_names(names: Iterable[str], specs: Sequence[str]) -> set[str]:
    """The (clean) parameter names any of ``specs`` freezes."""
    return {n for n in (clean_param_name(x) for x in names) if any(matches(n, s) for s in specs)}


def freeze_record(cfg: VLMSettings | None, step: int) -> dict[str, object] | None:
    """What a checkpoint records: the specs frozen for the update after ``step`` (None: not a VLM)."""
    if cfg is None:
        return None
    return {"step": step, "frozen": list(frozen_specs_at(cfg, step))}


def freeze_mismatch(saved: Mapping[str, object] | None, ours: VLMSettings, step: int) -> str | None:
    """Why resuming at ``step`` with ``ours`` changes the effective freeze of the checkpoint's run, or None.

    Compares the specs frozen at ``step`` and at every later stage boundary of either
    configuration (the past is irrelevant to continuing), naming the modules that differ.
    """
    saved_cfg: Mapping[str, object] = saved or {}
    starts = (
        {step}
        | {s for s, _ in _config_stages(saved_cfg) if s > step}
        | {s for s, _ in _config_stages(ours) if s > step}
    )
    for at in sorted(starts):
        old, new = set(frozen_specs_at(saved_cfg, at)), set(frozen_specs_at(ours, at))
        if old == new:
            continue
        parts = []
        if old - new:
            parts.append(f"{', '.join(sorted(old - new))} frozen in the checkpoint's run but trained in this one")
        if new - old:
            parts.append(f"{', '.join(sorted(new - old))} frozen in this run but trained in the checkpoint's")
        when = "from the resume step" if at == step else f"from step {at}"
        return f"the freeze configuration differs {when} ({step=}): module " + "; module ".join(parts)
    return None
