"""A rewind: go back to the run's newest complete checkpoint and skip the data since (checkpoint work).

The loss-spike component (`engine.train.components.loss_spike`) decides when; a rewind, in
the same process and on every rank at the same step:

1. notes where the data loader stands (just after the spike's batches) and restores the
   run's newest complete checkpoint (model, optimizer, schedule, train state, RNGs, every
   component's state, data position) with the checkpoint manager's own restore;
2. moves the data loader back to where it stood, so the batches between the checkpoint
   and the spike are skipped;
3. records the skipped window in the train state (``data_skips``, carried by every later
   checkpoint) and in ``CHECKPOINT_ROOT/data_skips.json``, so a process that restarts from
   that same checkpoint before the next save skips the same window (`apply_recorded_skips`).
   The position the steps from there on read from goes to ``RUN_DIR/data_positions.jsonl``
   (`kforge data-trace`).

Without a checkpoint to go back to there is no rewind (the caller is told: None).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.json_values import dict_of, int_of
from kforge_cli.rundir import names
from kforge_cli.rundir.checkpoints import atomic_write_json, read_json
from kforge_cli.rundir.data_positions import record_data_position

if TYPE_CHECKING:
    from kforge_cli.engine.checkpoint import CheckpointManager
    from kforge_cli.engine.checkpoint.run_position import TrainState
    from kforge_cli.engine.data.loader import StatefulLoader
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")

JOURNAL = names.DATA_SKIPS_FILE


def rewind(session: TrainingSession, skip: dict[str, int], note: str = "") -> int | None:
    """Restore the newest complete checkpoint and skip the data up to now; the step rewound to, or None.

    ``skip`` names why (``spike_step``, ``detected_at``); the step rewound to and the steps
    skipped are added, and the whole record is kept in the train state and the journal.
    """
    ckpt, state = session.checkpointer, session.state
    loader = session.data.train
    detected_at = state.step
    data_after = loader.state_dict()
    restored = ckpt.rewind()
    if restored is None:
        log.warning("no complete checkpoint to rewind to: continuing without a rewind")
        return None
    data_before = loader.state_dict()
    loader.load_state_dict(data_after)
    skip = {**skip, "rewound_to": restored.step, "skipped_steps": detected_at - restored.step}
    state.data_skips.append(skip)
    if session.runtime.is_main:
        _journal_append(ckpt.root, {**skip, "data_before": data_before, "data_after": data_after})
        record_data_position(  # the steps from here on read the data after the skipped window
            session.run_dir,
            step=restored.step,
            reason="rewind",
            data=data_after,
            world_size=session.runtime.world_size,
            skip=skip,
        )
    log.warning(
        "rewound to step %d (%s); the data of steps %d-%d is skipped%s",
        restored.step,
        restored.path,
        restored.step + 1,
        detected_at,
        f" ({note})" if note else "",
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
