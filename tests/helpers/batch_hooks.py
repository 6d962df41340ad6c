"""A training hook that records every micro-batch the step received, for `kforge data-trace` tests.

`kforge train --train.hooks='["tests.helpers.batch_hooks:RecordBatches"]'` appends one JSON line
per micro-batch to ``$KFORGE_TEST_BATCHES/rank<dp rank>.jsonl``: the step, the micro-batch's
index in it, the data-parallel rank and the tensors as lists. A step run twice (a rewind, a
resume from an earlier checkpoint) is recorded twice; the later lines are what the run kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kforge_cli.engine.train import TrainHook

FIELDS = ("input_ids", "labels", "dataset_ids")


class _RecordingStep:
    """The session's step function, writing its micro-batches down first (everything else delegated)."""

    def __init__(self, inner: Any, out: Path) -> None:
        self.inner, self.out = inner, out

    def __call__(self, session: Any, micro_batches: list[dict[str, Any]]) -> Any:
        step, rank = session.state.step + 1, session.runtime.dp_rank
        with (self.out / f"rank{rank}.jsonl").open("a") as f:
            for j, batch in enumerate(micro_batches):
                record = {"step": step, "micro_batch": j, "rank": rank}
                record.update({k: batch[k].tolist() for k in FIELDS})
                f.write(json.dumps(record) + "\n")
        return self.inner(session, micro_batches)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RecordBatches(TrainHook):
    def __init__(self, out: Path | None = None) -> None:
        self.out = Path(out or os.environ["KFORGE_TEST_BATCHES"])

    def on_train_begin(self, session: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        session.step_fn = _RecordingStep(session.step_fn, self.out)


def recorded(out: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    """{(step, micro-batch, dp rank): the batch the run kept} (a later record of a step wins)."""
    kept: dict[tuple[int, int, int], dict[str, Any]] = {}
    for path in sorted(Path(out).glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            kept[(r["step"], r["micro_batch"], r["rank"])] = r
    return kept


class RecordBatchesAndSpike(RecordBatches):
    """Also scales every weight by 8 after step ``$KFORGE_TEST_SPIKE_STEP - 1`` (once per process): the loss
    of step ``$KFORGE_TEST_SPIKE_STEP`` spikes (a loss-spike rewind's cue; the rewind restores the weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.spike, self.done = int(os.environ["KFORGE_TEST_SPIKE_STEP"]), False

    def on_step_end(self, session: Any, info: Any) -> None:
        if not self.done and info.step == self.spike - 1:
            self.done = True
            for p in session.model.parameters():
                p.data.mul_(8.0)
