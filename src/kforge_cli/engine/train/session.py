"""`TrainingSession`: every piece of a run, assembled once by `engine.train.recipe.assemble`;
the loop-component protocol its methods receive (`LoopComponent`, `Components`, the verdicts
`Rewind` and `Stop`), and the user's hook interface (`TrainHook`, a loop component with the
older method names, and `StepInfo`).

The protocol lives here, next to the session its methods receive, so that neither module
imports the other; `engine.train.components` re-exports it with the components kforge ships
(`engine.train.components.selection`), and `engine.train.hooks` loads hooks named in the settings.

A step feature (`engine.train.step.StepFeature`) changes what one step computes; a loop
component acts between steps: it votes to stop, decides on a loss spike, watches for hangs,
evaluates, reports. The loop calls every component in list order at these points:

- ``on_train_begin(session)``: once, before the first step (after any resume);
- ``phase(name, step)``: the loop enters a phase (``"data"``, ``"update"``, ...) with ``step``
  optimizer steps done (what a hang report names);
- ``before_step(session, step)``: at the step boundary; may return ``Stop`` (the stop vote);
- ``before_update(session)`` and ``on_update(session, info)``: just before and just after the
  optimizer update (``info.step_time_s`` is set later);
- ``on_log(session, record)``: on a logging step, add keys to the record before it is written;
- ``after_update(session, info)``: after the step's log line, ``None`` (continue),
  ``Rewind()`` (the run was rewound: the loop restarts its data iterator) or ``Stop(...)``;
  the first component that does not continue wins, later ones are not asked;
- ``on_eval_end(session, step, eval_loss)``, ``on_save(session, step, path)``,
  ``on_rewind(session)``: an evaluation, a checkpoint, a rewind happened;
- ``on_loop_end(session, how)``: before the run's last save (``how.status``: completed,
  stopped, early_stop); ``on_train_end(session, status)`` after the loop (``"failed"`` on an
  exception); ``close()`` always, last.

A component with a ``name`` has its ``state_dict()`` saved in every checkpoint under that
name and given back to ``load_state_dict`` on resume; the checkpoint does not know what it
is. ``legacy_state(train_state)`` lets a component read a checkpoint written before it had
its own name (None: nothing there).

User hooks (`TrainHook`, ``train.hooks``) are loop components with the older method names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.data import TrainData
from kforge_cli.engine.observe import Tracker
from kforge_cli.engine.parallel import PipelineBundle
from kforge_cli.engine.resilience import NanGuard, ShutdownHandler
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.train.loss import LossFn
from kforge_cli.settings import JobSettings

if TYPE_CHECKING:
    from kforge_cli.engine.train.loss_scaler import LossScaler
    from kforge_cli.engine.train.step.result import StepResult
    from kforge_cli.engine.train.update import Update

Batch = dict[str, torch.Tensor]
"""One micro-batch on the device: ``input_ids``, ``labels`` and optional model inputs."""


class StepFn(Protocol):
    """What the loop calls: the step once per optimizer step, `after_update` after the optimizer update.

    kforge's are an executor with features (engine.train.step, engine.train.features).
    """

    def __call__(self, session: TrainingSession, micro_batches: list[Batch], /) -> StepResult: ...

    def after_update(self, session: TrainingSession, /) -> None: ...


Status = Literal["completed", "stopped", "early_stop"]
"""How a run ended (`TrainOutcome.status`)."""


@dataclass(frozen=True)
class Rewind:
    """The component restored an earlier checkpoint: the loop restarts its data iterator."""


@dataclass(frozen=True)
class Stop:
    """End the run after this step: ``status`` for the outcome, ``reason`` for the user."""

    status: Status
    reason: str
    signal: str | None = None


Verdict = Rewind | Stop | None
"""What ``before_step`` / ``after_update`` return; None continues."""


class LoopComponent:
    """Acts around the step; subclass it and override what you need (every method is a no-op here)."""

    name: str = ""  # non-empty: state_dict() is saved in every checkpoint under this name

    def on_train_begin(self, session: TrainingSession) -> None: ...

    def phase(self, name: str, step: int) -> None: ...

    def before_step(self, session: TrainingSession, step: int) -> Verdict:
        return None

    def before_update(self, session: TrainingSession) -> None: ...

    def on_update(self, session: TrainingSession, info: StepInfo) -> None: ...

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None: ...

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        return None

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None: ...

    def on_save(self, session: TrainingSession, step: int, path: str) -> None: ...

    def on_rewind(self, session: TrainingSession) -> None: ...

    def on_loop_end(self, session: TrainingSession, how: Stop) -> None: ...

    def on_train_end(self, session: TrainingSession, status: str) -> None: ...

    def close(self) -> None: ...

    def state_dict(self) -> object:
        return None

    def load_state_dict(self, state: object) -> None: ...

    def legacy_state(self, train_state: Mapping[str, object]) -> object:
        return None


C = TypeVar("C", bound=LoopComponent)


class Components(LoopComponent):
    """The run's components in order; each call goes to all of them (a verdict: the first one)."""

    def __init__(self, items: Iterable[LoopComponent]) -> None:
        self.items = list(items)
        names = [c.name for c in self.items if c.name]
        if len(names) != len(set(names)):
            raise ValueError(f"loop components share a name: {names}")
        self._phased = [c for c in self.items if type(c).phase is not LoopComponent.phase]
        self.last_eval_loss: float | None = None

    @property
    def hooks(self) -> list[LoopComponent]:
        """The same list (the name older code used)."""
        return self.items

    def named(self) -> dict[str, LoopComponent]:
        """The components whose state every checkpoint carries, by name."""
        return {c.name: c for c in self.items if c.name}

    def get(self, kind: type[C]) -> C | None:
        """The first component of type ``kind`` (None when this run has none)."""
        return next((c for c in self.items if isinstance(c, kind)), None)

    def on_train_begin(self, session: TrainingSession) -> None:
        for c in self.items:
            c.on_train_begin(session)

    def phase(self, name: str, step: int) -> None:
        for c in self._phased:
            c.phase(name, step)

    def before_step(self, session: TrainingSession, step: int) -> Verdict:
        for c in self.items:
            verdict = c.before_step(session, step)
            if verdict is not None:
                return verdict
        return None

    def before_update(self, session: TrainingSession) -> None:
        for c in self.items:
            c.before_update(session)

    def on_update(self, session: TrainingSession, info: StepInfo) -> None:
        for c in self.items:
            c.on_update(session, info)

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None:
        for c in self.items:
            c.on_log(session, record)

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        for c in self.items:
            verdict = c.after_update(session, info)
            if verdict is not None:
                return verdict
        return None

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None:
        self.last_eval_loss = eval_loss
        for c in self.items:
            c.on_eval_end(session, step, eval_loss)

    def on_save(self, session: TrainingSession, step: int, path: str) -> None:
        for c in self.items:
            c.on_save(session, step, path)

    def on_rewind(self, session: TrainingSession) -> None:
        for c in self.items:
            c.on_rewind(session)

    def on_loop_end(self, session: TrainingSession, how: Stop) -> None:
        for c in self.items:
            c.on_loop_end(session, how)

    def on_train_end(self, session: TrainingSession, status: str) -> None:
        for c in self.items:
            c.on_train_end(session, status)

    def close(self) -> None:
        for c in self.items:
            c.close()


@dataclass
class StepInfo:
    """What a finished optimizer step produced (all values global across ranks).

    ``loss``, ``grad_norm``, ``extra`` and ``skipped`` are read from the device when first
    asked for: a hook that reads them every step adds a device sync to every step, so read
    them on the steps you log (``log_step``).
    """

    step: int
    lr: float
    tokens_seen: int
    step_time_s: float
    result: StepResult
    skipped_flag: bool | torch.Tensor = False  # a device flag when the update was decided on the device
    data_time_s: float = 0.0  # fetching this step's batches (host time)
    log_step: bool = False  # a metrics record is written for this step

    @property
    def loss(self) -> float:
        return self.result.read().loss

    @property
    def grad_norm(self) -> float:
        """Before clipping (and before gradients are zeroed)."""
        return self.result.read().grad_norm

    @property
    def extra(self) -> dict[str, float]:
        return self.result.read().extra

    @property
    def skipped(self) -> bool:
        return bool(self.skipped_flag)


class TrainHook(LoopComponent):
    """Observe (or steer) a run without editing the loop: subclass and override what you need.

    Register hooks from Python (`run_training(settings, hooks=[MyHook()])`) or from settings
    by import path (`train.hooks = ["my_pkg.hooks:LogGradNorms"]`, see `engine.train.hooks`).
    A hook is a loop component (`engine.train.components`) with these names: ``on_step_end``
    is its ``after_update`` (it never stops or rewinds the run), ``on_checkpoint_save`` its
    ``on_save``. Every method is a no-op here.
    """

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None: ...

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None: ...

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        self.on_step_end(session, info)
        return None

    def on_save(self, session: TrainingSession, step: int, path: str) -> None:
        self.on_checkpoint_save(session, step, path)


HookList = Components
"""The run's components (hooks included), called in order: the name older code used."""


@dataclass
class TrainingSession:
    """The assembled run. Fields are plain attributes so an experiment can swap one piece."""

    settings: JobSettings
    runtime: RuntimeContext
    run_dir: Path
    model: nn.Module
    pipeline: PipelineBundle | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    update: Update  # the optimizer update: the NaN policy's decision and, under fp16, the loss scale
    loss_fn: LossFn
    data: TrainData
    components: Components  # what acts around the step, user hooks included (engine.train.components)
    metrics: Tracker  # rank 0: metrics.jsonl and the experiment trackers; other ranks: the null tracker
    shutdown: ShutdownHandler  # a hook may set its signal_name to ask the run to stop (with a checkpoint)
    checkpointer: CheckpointManager
    step_fn: StepFn  # an executor with its features (engine.train.features.build_step)
    compute_dtype: torch.dtype
    state: TrainState = field(default_factory=TrainState)

    @property
    def grad_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler of the update (None in bf16 and fp32)."""
        return self.update.scaler

    @property
    def nan_guard(self) -> NanGuard:
        """The NaN policy's guard the update consults."""
        return self.update.guard

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def tokens_per_step(self) -> int:
        """Global tokens consumed by one optimizer step (all data-parallel ranks)."""
        return self.settings.train.tokens_per_step(self.runtime.dp_size)

    def autocast(self) -> AbstractContextManager[Any]:
        """Mixed precision for a single-device model (FSDP2 casts parameters itself)."""
        if self.compute_dtype == torch.float32 or self.runtime.world_size > 1:
            return nullcontext()
        return torch.autocast(device_type=self.runtime.device.type, dtype=self.compute_dtype)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
