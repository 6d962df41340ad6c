"""Training hooks: observe (or steer) a run without editing the loop.

Subclass `TrainHook` and override what you need. Register hooks from Python
(`run_training(settings, hooks=[MyHook()])`) or from settings by import path
(`train.hooks = ["my_pkg.hooks:LogGradNorms"]`; the class is instantiated with no
arguments, or with the settings when its constructor has one required argument).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kforge_cli.errors import InvalidInputError

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")


@dataclass
class StepInfo:
    """What a finished optimizer step produced (all values global across ranks)."""

    step: int
    loss: float
    grad_norm: float  # before clipping (and before gradients are zeroed)
    lr: float
    tokens_seen: int
    step_time_s: float
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class TrainHook:
    """Base class: every method is a no-op."""

    def on_train_begin(self, session: TrainingSession) -> None: ...

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None: ...

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None: ...

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None: ...

    def on_train_end(self, session: TrainingSession, status: str) -> None: ...


class HookList(TrainHook):
    """Calls every hook in order."""

    def __init__(self, hooks: list[TrainHook]) -> None:
        self.hooks = list(hooks)

    def on_train_begin(self, session: TrainingSession) -> None:
        for h in self.hooks:
            h.on_train_begin(session)

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None:
        for h in self.hooks:
            h.on_step_end(session, info)

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None:
        for h in self.hooks:
            h.on_eval_end(session, step, eval_loss)

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None:
        for h in self.hooks:
            h.on_checkpoint_save(session, step, path)

    def on_train_end(self, session: TrainingSession, status: str) -> None:
        for h in self.hooks:
            h.on_train_end(session, status)


def load_hook(spec: str, settings: Any) -> TrainHook:
    """Instantiate 'package.module:ClassName' (a clear error when it cannot be imported)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidInputError(f"train.hooks: {spec!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"train.hooks: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise InvalidInputError(f"train.hooks: module {module_name!r} has no attribute {attr!r}")
    required = [
        p
        for p in inspect.signature(cls).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    hook = cls(settings) if len(required) == 1 else cls()
    if not isinstance(hook, TrainHook):
        raise InvalidInputError(f"train.hooks: {spec} is not a kforge_cli.engine.train.TrainHook subclass")
    return hook


def build_hooks(settings: Any, extra: list[TrainHook] | None) -> HookList:
    """Hooks from settings (by import path) followed by those passed from Python."""
    hooks = [load_hook(spec, settings) for spec in settings.train.hooks]
    return HookList(hooks + list(extra or []))
