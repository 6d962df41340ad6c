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


def test_component_names_are_unique_and_update_is_the_updates(tmp_path: Path) -> None:
    import pytest

    from kforge_cli.engine.train import run_training
    from kforge_cli.engine.train.components import Components, LoopComponent
    from tests.helpers.tiny_run import tiny_settings

    class Named(LoopComponent):
        def __init__(self, name: str) -> None:
            self.name = name

    with pytest.raises(ValueError, match="share a name"):
        Components([Named("a"), Named("a")])
    settings = tiny_settings("--model.vocab_size=320", "--train.max_steps=1", f"--train.run_dir={tmp_path / 'run'}")
    with pytest.raises(ValueError, match="may not be named 'update'"):  # it would replace the loss scale's state
        run_training(settings, hooks=[Named("update")])
