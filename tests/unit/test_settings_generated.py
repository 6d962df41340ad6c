"""Generated over the whole settings model: every field refuses wrong types, non-finite and out-of-range values.

For every field of every section (including list elements such as ``data.datasets[0]``)
the test derives bad values from the field's annotation and constraints: values of the
wrong type, NaN and +-inf for numbers, the value just past each bound, and a control
character for strings. Each must be a :class:`ConfigError` (exit 2) naming the dotted key;
a sample goes through the real ``kforge validate-config`` in tests/e2e/test_hostile_inputs.py.
A new field is covered automatically; a numeric field without a natural lower bound fails
`test_every_numeric_field_has_a_range` unless it is listed there with a reason.
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel

from kforge_cli.errors import ConfigError
from kforge_cli.settings import JobSettings, load_settings
from kforge_cli.settings.config_layers import nest

NONE = type(None)
UNBOUNDED: dict[str, str] = {}  # dotted key -> why a numeric field has no natural lower bound


@dataclass(frozen=True)
class Case:
    key: str  # the dotted key the error must name
    value: Any
    why: str

    @property
    def id(self) -> str:
        return f"{self.key}={self.value!r}"[:80]


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not NONE]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _split_annotated(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        flat = []
        for m in extra:
            flat += getattr(m, "metadata", [m])
        return base, metadata + flat
    return annotation, metadata


def _sample(annotation: Any) -> Any:
    """A valid value of `annotation` (for required fields of list elements)."""
    annotation = _strip_optional(_split_annotated(annotation, [])[0])
    if annotation is str:
        return "x"
    if annotation is int:
        return 0
    if annotation is float:
        return 0.5  # inside every float range the settings use
    return None


def _minimal(model: type[BaseModel]) -> dict[str, Any]:
    return {name: _sample(info.annotation) for name, info in model.model_fields.items() if info.is_required()}


def _bound_cases(key: str, kind: type, metadata: list[Any]) -> list[Case]:
    cases = []
    for m in metadata:
        if isinstance(m, at.Gt):
            cases += [Case(key, m.gt, "= exclusive lower bound"), Case(key, m.gt - 1, "below lower bound")]
        elif isinstance(m, at.Ge):
            cases.append(Case(key, m.ge - 1 if kind is int else m.ge - 0.5, "below lower bound"))
        elif isinstance(m, at.Lt):
            cases += [Case(key, m.lt, "= exclusive upper bound"), Case(key, m.lt + 1, "above upper bound")]
        elif isinstance(m, at.Le):
            cases.append(Case(key, m.le + 1 if kind is int else m.le + 0.5, "above upper bound"))
    return cases


def _value_cases(key: str, annotation: Any, metadata: list[Any]) -> list[Case]:
    """Bad values for one value of type `annotation` at `key`."""
    annotation, metadata = _split_annotated(_strip_optional(annotation), metadata)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is bool:
        return [Case(key, "maybe", "wrong type"), Case(key, [True], "wrong type"), Case(key, 2, "wrong type")]
    if annotation in (int, float):
        wrong = [Case(key, "abc", "wrong type"), Case(key, [1], "wrong type"), Case(key, {"a": 1}, "wrong type")]
        if annotation is int:
            wrong.append(Case(key, 1.5, "wrong type"))
        finite = [Case(key, v, "non-finite") for v in (math.nan, math.inf, -math.inf)]
        return wrong + finite + _bound_cases(key, annotation, metadata)
    if annotation is str:
        return [Case(key, 5, "wrong type"), Case(key, ["a"], "wrong type"), Case(key, "a\nb", "control character")]
    if origin is Literal:
        return [Case(key, "no-such-choice", "not a choice"), Case(key, 3, "wrong type")]
    if origin is list:
        element = f"{key}.0"
        inner = _value_cases(element, args[0], [])
        of_models = isinstance(args[0], type) and issubclass(args[0], BaseModel)
        # a model element's field cases stay bare (_wrap builds the element); others carry the whole list
        return [Case(key, "x", "wrong type"), Case(key, {"a": 1}, "wrong type")] + [
            c if of_models and c.key != element else Case(c.key, [c.value], c.why) for c in inner
        ]
    if origin is tuple:
        inner = [_value_cases(f"{key}.{i}", a, []) for i, a in enumerate(args)]
        good = [_sample(a) for a in args]
        cases = [Case(key, "x", "wrong type"), Case(key, good[:-1], "too short"), Case(key, [*good, 0.5], "too long")]
        for i, per_index in enumerate(inner):
            cases += [Case(c.key, [*good[:i], c.value, *good[i + 1 :]], c.why) for c in per_index]
        return cases
    if origin is dict:
        inner = _value_cases(f"{key}.k", args[1], [])
        return [Case(key, "x", "wrong type"), Case(key, ["a"], "wrong type")] + [
            Case(c.key, {"k": c.value}, c.why) for c in inner if c.key == f"{key}.k"
        ]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model_cases(key, annotation)
    raise AssertionError(f"{key}: no generator for {annotation!r}; extend _value_cases")


def _model_cases(prefix: str, model: type[BaseModel]) -> list[Case]:
    """Cases for every field of `model` (keys under `prefix`), and a wrong type for the model itself."""
    cases = [Case(prefix, "x", "wrong type")] if prefix else []
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        cases += _value_cases(key, info.annotation, list(info.metadata))
    return cases


def _wrap(c: Case) -> dict[str, Any]:
    """The loader input for a case: its value nested at its key, list elements wrapped in a minimal model.

    List-of-model cases come out of `_value_cases` as ``key.0.field`` with the bare field
    value; here they become ``{key: [{required fields..., field: value}]}``.
    """
    parts = c.key.split(".")
    model: type[BaseModel] = JobSettings
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            break
        ann = _strip_optional(info.annotation)
        element = typing.get_args(ann)[0] if typing.get_origin(ann) is list and typing.get_args(ann) else None
        is_model_list = isinstance(element, type) and issubclass(element, BaseModel)
        if is_model_list and i + 2 < len(parts) and parts[i + 1] == "0":
            assert isinstance(element, type)
            item = _minimal(element) | {parts[i + 2]: c.value}
            return nest(".".join(parts[: i + 1]), [item])
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        model = ann
    return nest(c.key, c.value) if not _is_container_case(c) else nest(_container_key(c), c.value)


def _is_container_case(c: Case) -> bool:
    """Cases for list/tuple/dict elements carry the whole container as value, keyed by the element."""
    tail = c.key.rsplit(".", 1)[-1]
    return tail.isdigit() or tail == "k"


def _container_key(c: Case) -> str:
    return c.key.rsplit(".", 1)[0]


def generated_cases() -> list[tuple[dict[str, Any], Case]]:
    """(settings input for the loader's base layer, case) for every generated bad value."""
    return [(_wrap(c), c) for c in _model_cases("", JobSettings)]


CASES = generated_cases()


def test_generated_cases_cover_every_field() -> None:
    keys = {c.key for _, c in CASES}
    expected = []
    for name, info in JobSettings.model_fields.items():
        section = _strip_optional(info.annotation)
        if isinstance(section, type) and issubclass(section, BaseModel):
            expected += [f"{name}.{sub}" for sub in section.model_fields]
        else:
            expected.append(name)
    uncovered = [k for k in expected if not any(c == k or c.startswith(k + ".") for c in keys)]
    assert not uncovered
    print(f"{len(CASES)} generated cases over {len(expected)} settings")
    assert len(CASES) > 600


def test_every_numeric_field_has_a_range() -> None:
    missing = []
    for section_name, info in JobSettings.model_fields.items():
        section = _strip_optional(info.annotation)
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        for name, sub in section.model_fields.items():
            base = _strip_optional(sub.annotation)
            if base in (int, float) and not any(isinstance(m, at.Gt | at.Ge) for m in sub.metadata):
                key = f"{section_name}.{name}"
                if key not in UNBOUNDED:
                    missing.append(key)
    assert not missing, f"numeric settings without a lower bound (add gt/ge, or list in UNBOUNDED): {missing}"


def test_every_generated_bad_value_is_a_config_error_naming_its_key() -> None:
    failures = []
    for data, c in CASES:
        # a control character inside a list/dict is reported at the setting's key, with the item named
        key = _container_key(c) if c.why == "control character" and _is_container_case(c) else c.key
        try:
            load_settings(base=data, use_env=False)
        except ConfigError as exc:
            if exc.exit_code != 2 or not re.search(rf"- {re.escape(key)}[.:]", str(exc)):
                failures.append(f"{c.id} ({c.why}): exit {exc.exit_code}, message {str(exc)[:200]!r}")
        except Exception as exc:  # a traceback in the CLI
            failures.append(f"{c.id} ({c.why}): {type(exc).__name__}: {exc}")
        else:
            failures.append(f"{c.id} ({c.why}): accepted")
    assert not failures, f"{len(failures)} of {len(CASES)} cases:\n" + "\n".join(failures[:40])
