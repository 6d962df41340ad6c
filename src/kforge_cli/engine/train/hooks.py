"""Training hooks named in the settings: `train.hooks = ["my_pkg.hooks:LogGradNorms"]`.

The hook interface (`TrainHook`, `HookList`, `StepInfo`) is defined next to the session in
`engine.train.session` and re-exported here. A class named in the settings is checked to
be a `TrainHook` subclass before it is instantiated (with no arguments, or with the
settings when its constructor has exactly one required argument).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Sequence
from typing import Any

from kforge_cli.engine.train.components import LoopComponent
from kforge_cli.engine.train.session import HookList, StepInfo, TrainHook
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")


def load_hook(spec: str, settings: JobSettings) -> TrainHook:
    """Instantiate 'package.module:ClassName' (a clear error when it cannot be imported)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidInputError(f"train.hooks: {spec!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        top = module_name.split(".", 1)[0]
        raise InvalidInputError(
            f"train.hooks: cannot import module {module_name!r} ({exc}). Python looks for it on sys.path, which "
            f"holds the installed packages but not the working directory: run from the directory that holds "
            f"{top}/ with PYTHONPATH=. (e.g. `PYTHONPATH=. kforge train ...`), or install {top} into this environment"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise InvalidInputError(f"train.hooks: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, TrainHook)):  # checked before anything of it runs
        raise InvalidInputError(f"train.hooks: {spec} is not a kforge_cli.engine.train.TrainHook subclass")
    required = [
        p
        for p in inspect.signature(cls).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    hook_cls: Any = cls  # a TrainHook subclass whose constructor may take the settings
    return hook_cls(settings) if len(required) == 1 else hook_cls()


def build_hooks(settings: JobSettings, extra: Sequence[LoopComponent] | None) -> list[LoopComponent]:
    """Hooks from settings (by import path) followed by those passed from Python."""
    if settings.train.hooks:
        log.info("importing train.hooks: %s", ", ".join(settings.train.hooks))
    hooks: list[LoopComponent] = [load_hook(spec, settings) for spec in settings.train.hooks]
    return hooks + list(extra or [])


__all__ = ["HookList", "StepInfo", "TrainHook", "build_hooks", "load_hook"]
