"""The NaN policy around the step: its tallies settled on logging steps and at the end, its counters checkpointed.

The per-step decision happens inside the optimizer update (`engine.train.update`), on the
device where it can; this component owns the guard (`engine.resilience.NanGuard`) that the
update consults and reads its device tallies at the agreed points (every rank, same steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kforge_cli.common.json_values import dict_of
from kforge_cli.engine.resilience import NanGuard
from kforge_cli.engine.train.components import LoopComponent, Stop

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession
    from kforge_cli.settings.infrastructure import ResilienceSettings


class NanPolicy(LoopComponent):
    """``resilience.nan_policy``: settles the guard's tallies, reports ``nan_steps``, carries its counters."""

    name = "nan_policy"

    def __init__(self, cfg: ResilienceSettings) -> None:
        self.guard = NanGuard.from_settings(cfg)

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None:
        self.guard.settle()  # every rank, the same steps: the abort decision stays agreed
        if self.guard.total_bad:
            record["nan_steps"] = self.guard.total_bad

    def on_loop_end(self, session: TrainingSession, how: Stop) -> None:
        self.guard.settle()

    def state_dict(self) -> object:
        return self.guard.state_dict()

    def load_state_dict(self, state: object) -> None:
        self.guard.load_state_dict({k: int(v) for k, v in dict_of(state, "nan_policy").items()})  # type: ignore[call-overload]

    def legacy_state(self, train_state: Mapping[str, object]) -> object:
        return train_state.get("nan_guard")
