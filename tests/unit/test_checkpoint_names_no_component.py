"""The checkpoint layer saves and restores every named part without knowing what it is (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

import kforge_cli.engine.checkpoint as checkpoint

# Guards, monitors and hooks that live in the loop components (engine.train.components) or the update.
NAMES = [
    "nan_guard",
    "nanguard",
    "nan_policy",
    "spike",
    "grad_scaler",
    "loss_scale",
    "watchdog",
    "straggler",
    "profiler",
    "early_stop",
    "TrainHook",
    "on_step_end",
    "on_checkpoint_save",
    "on_train_begin",
    "on_train_end",
    "on_eval_end",
]


def test_engine_checkpoint_names_no_guard_monitor_or_hook() -> None:
    root = Path(checkpoint.__file__).parent
    pattern = re.compile("|".join(NAMES), re.IGNORECASE)
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert found == []
