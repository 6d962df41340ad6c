"""Acting on a loss spike (``resilience.spike_policy``): report it, or rewind and skip its data.

A rewind, in the same process and on every rank at the same step (the spike decision is
agreed, see `engine.resilience.spike`):

1. notes where the data loader stands (just after the spike's batches) and restores the
   run's newest complete checkpoint (model, optimizer, schedule, train state, RNGs, NaN
   and spike guards, data position) with the checkpoint manager's own restore;
2. moves the data loader back to where it stood, so the batches between the checkpoint
   and the spike are skipped;
3. records the skipped window in the train state (``data_skips``, carried by every later
   checkpoint) and in ``CHECKPOINT_ROOT/data_skips.json``, so a process that restarts from
   that same checkpoint before the next save skips the same window (`apply_recorded_skips`).

Every detection and rewind is a ``metrics.jsonl`` record (and so a tracker point) and a
log line. Without a checkpoint to go back to, or after ``resilience.spike_max_rewinds``
rewinds, a spike is only reported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kforge_cli.engine.resilience.spike import SpikeEvent
from kforge_cli.json_values import dict_of, int_of
from kforge_cli.rundir import names
from kforge_cli.rundir.checkpoints import atomic_write_json, read_json

if TYPE_CHECKING:
    from kforge_cli.engine.checkpoint import CheckpointManager
    from kforge_cli.engine.data.loader import StatefulLoader
    from kforge_cli.engine.train.session import TrainingSession
    from kforge_cli.engine.train.train_state import TrainState

log = logging.getLogger("kforge")

JOURNAL = names.DATA_SKIPS_FILE


def settle_spikes(session: TrainingSession) -> SpikeEvent | None:
    """The spikes since the last check, agreed across ranks (a collective when distributed)."""
    guard = session.spike_guard
    if not guard.enabled:
        return None

    def from_rank_0(tally: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tally, src=0)
        return tally

    return guard.settle(from_rank_0 if session.runtime.world_size > 1 else None)


def handle_spike(session: TrainingSession, event: SpikeEvent) -> bool:
    """Report ``event``; rewind when the policy says so. True when the run was rewound."""
    guard, step = session.spike_guard, session.state.step
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
    restored_to = rewind(session, event)
    if restored_to is None:
        session.metrics.write(record)
        return False
    record.update(
        {
            "spike/rewound_to": restored_to,
            "spike/skipped_steps": step - restored_to,
            "spike/rewinds": guard.rewinds,
        }
    )
    session.metrics.write(record)
    return True


def rewind(session: TrainingSession, event: SpikeEvent) -> int | None:
    """Restore the newest complete checkpoint and skip the data up to now; the step rewound to, or None."""
    ckpt, guard, state = session.checkpointer, session.spike_guard, session.state
    loader = session.data.train
    detected_at, spike_steps = state.step, guard.detected
    rewinds = guard.rewinds
    data_after = loader.state_dict()
    restored = ckpt.rewind()
    if restored is None:
        log.warning("no complete checkpoint to rewind to: continuing without a rewind")
        return None
    data_before = loader.state_dict()
    loader.load_state_dict(data_after)
    guard.rewinds, guard.detected = rewinds + 1, spike_steps  # the checkpoint's counts are older
    skip = {
        "spike_step": event.step,
        "detected_at": detected_at,
        "rewound_to": restored.step,
        "skipped_steps": detected_at - restored.step,
    }
    state.data_skips.append(skip)
    if session.runtime.is_main:
        _journal_append(ckpt.root, {**skip, "data_before": data_before, "data_after": data_after})
    log.warning(
        "rewound to step %d (%s); the data of steps %d-%d is skipped (rewind %d of at most %d)",
        restored.step,
        restored.path,
        restored.step + 1,
        detected_at,
        guard.rewinds,
        guard.max_rewinds,
    )
    return restored.step


def _journal_append(root: Path, entry: dict[str, object]) -> None:
    path = root / JOURNAL
    entries = _journal(path)
    entries.append(entry)
    atomic_write_json(path, {"format": 1, "entries": entries})


def _journal(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        return []
    try:
        entries = read_json(path).get("entries")
    except Exception as exc:  # a damaged journal must not stop a resume; say so
        log.warning("ignoring %s: %s", path, exc)
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _canonical(value: object) -> object:
    return json.loads(json.dumps(value))


def apply_recorded_skips(checkpointer: CheckpointManager, loader: StatefulLoader, state: TrainState) -> None:
    """After a resume: when a rewind went back to this very checkpoint (same step, same data position)
    and skipped data from there, skip it again (the journal is read on rank 0 and broadcast)."""
    restored = checkpointer.restored
    if restored is None or restored.kind != "resume":
        return
    path = checkpointer.root / JOURNAL
    entries = checkpointer.groups.broadcast(_journal(path) if checkpointer.is_main else None)
    here = _canonical(loader.state_dict())
    matching = [e for e in entries if e.get("rewound_to") == state.step and e.get("data_before") == here]
    if not matching:
        return
    entry = matching[-1]  # a later rewind to the same checkpoint skipped further
    loader.load_state_dict(dict_of(entry["data_after"], "data_after"))
    skip = {k: int_of(entry[k]) for k in ("spike_step", "detected_at", "rewound_to", "skipped_steps")}
    if skip not in state.data_skips:
        state.data_skips.append(skip)
    log.warning(
        "resumed at step %d, where a loss-spike rewind skipped the data of steps %d-%d (%s): skipping it again",
        state.step,
        state.step + 1,
        skip["detected_at"],
        path,
    )
