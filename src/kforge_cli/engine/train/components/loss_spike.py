"""The loss-spike decision (``resilience.spike_policy``): report a spike, or rewind and skip its data.

The guard (`engine.resilience.SpikeGuard`) watches each step's loss on the device; on logging
steps and before a save the ranks agree on what it saw (one broadcast). A spike is a
``metrics.jsonl`` record and a log line; under ``rewind`` the run goes back to its newest
complete checkpoint and skips the data up to here (`engine.train.rewind`, checkpoint work),
at most ``resilience.spike_max_rewinds`` times.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kforge_cli.engine.resilience import SpikeEvent, SpikeGuard
from kforge_cli.engine.train.components import LoopComponent, Rewind, Stop, Verdict
from kforge_cli.engine.train.rewind import rewind

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession
    from kforge_cli.settings.infrastructure import ResilienceSettings

log = logging.getLogger("kforge")


class LossSpike(LoopComponent):
    """Watches the loss for spikes (built only when ``resilience.spike_policy`` is not off)."""

    name = "loss_spike"

    def __init__(self, cfg: ResilienceSettings) -> None:
        self.guard = SpikeGuard.from_settings(cfg)

    def on_update(self, session: TrainingSession, info: StepInfo) -> None:
        self.guard.observe(info.step, info.result.loss)  # on the device; decided below

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        if not (info.log_step or session.checkpointer.due(info.step)):
            return None
        session.components.phase("spike check", info.step)
        event = self.settle(session)  # every rank, the same steps: one broadcast
        if event is None:
            return None
        session.components.phase("rewind", info.step)  # restoring a checkpoint may take long
        return Rewind() if self.handle(session, event) else None

    def on_loop_end(self, session: TrainingSession, how: Stop) -> None:
        if how.status != "stopped":
            return
        event = self.settle(session)
        if event is not None:
            session.components.phase("rewind", session.state.step)
            self.handle(session, event)  # a rewind leaves the last checkpoint as the one to resume

    def settle(self, session: TrainingSession) -> SpikeEvent | None:
        """The spikes since the last check, agreed across ranks (a collective when distributed)."""

        def from_rank_0(tally: torch.Tensor) -> torch.Tensor:
            dist.broadcast(tally, src=0)
            return tally

        return self.guard.settle(from_rank_0 if session.runtime.world_size > 1 else None)

    def handle(self, session: TrainingSession, event: SpikeEvent) -> bool:
        """Report ``event``; rewind when the policy says so. True when the run was rewound."""
        guard, step = self.guard, session.state.step
        record: dict[str, object] = {"step": step, **event.record(), "spike/detected_total": guard.detected}
        rewinding = guard.may_rewind
        what = "rewinding to the last checkpoint" if rewinding else "reporting only"
        if guard.policy == "rewind" and not rewinding:
            what += f" (resilience.spike_max_rewinds = {guard.max_rewinds} reached)"
        log.warning(
            "loss spike at step %d: loss %.4f > threshold %.4f (%d spiking step(s) up to step %d): %s",
            event.step,
            event.loss,
            event.threshold,
            event.count,
            step,
            what,
        )
        if not rewinding:
            session.metrics.write(record)
            return False
        rewinds, detected = guard.rewinds, guard.detected
        skip = {"spike_step": event.step, "detected_at": step}
        restored_to = rewind(session, skip, note=f"rewind {rewinds + 1} of at most {guard.max_rewinds}")
        if restored_to is None:
            session.metrics.write(record)
            return False
        guard.rewinds, guard.detected = rewinds + 1, detected  # the checkpoint's counts are older
        record.update(
            {"spike/rewound_to": restored_to, "spike/skipped_steps": step - restored_to, "spike/rewinds": guard.rewinds}
        )
        session.metrics.write(record)
        return True

    def state_dict(self) -> object:
        return self.guard.state_dict()

    def load_state_dict(self, state: object) -> None:
        self.guard.load_state_dict(state)  # type: ignore[arg-type]

    def legacy_state(self, train_state: Mapping[str, object]) -> object:
        return train_state.get("spike_guard")
