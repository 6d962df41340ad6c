"""The worked examples of docs/extending.md (docs/examples/*.py) train as the page says.

Each example runs a few steps of a tiny model through the real `run_training`, with the
example swapped in the way the page shows, and the test checks what the example promises.
The examples use the step-feature design (engine.train.step, engine.train.features, the
recipe's phases by keyword); in a tree without it the module is skipped and says why.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip(
    "kforge_cli.engine.train.features", reason="the step-feature design (engine.train.features) is not in this tree"
)

from kforge_cli.engine.train import TrainHook, run_training
from kforge_cli.engine.train.features import features_for
from kforge_cli.settings import JobSettings, load_settings

EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"
TINY = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=320",
    "--model.max_seq_len=32",
    "--train.seq_len=16",
    "--train.batch_size=4",
    "--train.device=cpu",
    "--train.mixed_precision=fp32",
    "--scheduler.warmup_steps=1",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=0",
]


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings(run_dir: Path, *overrides: str) -> JobSettings:
    return load_settings(overrides=[*TINY, f"--train.run_dir={run_dir}", *overrides], use_env=False).settings


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class EmbeddingAfterEachStep(TrainHook):
    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_step_end(self, session: Any, info: Any) -> None:
        self.weights.append(session.model.tok_embeddings.weight.detach().clone())


def test_the_step_feature_freezes_the_embeddings_for_its_warmup(tmp_path: Path) -> None:
    feature = example("step_feature").FreezeEmbeddingsForWarmup
    seen = EmbeddingAfterEachStep()
    run = tmp_path / "run"
    outcome = run_training(
        settings(run, "--train.max_steps=4"),
        features=lambda s: [*features_for(s), feature(steps=2)],
        hooks=[seen],
    )
    assert outcome.status == "completed"
    w = seen.weights
    assert torch.equal(w[0], w[1])  # updates 1 and 2: frozen
    assert not torch.equal(w[1], w[2]) and not torch.equal(w[2], w[3])  # then trained
    frozen = [r["embeddings_frozen"] for r in records(run) if "embeddings_frozen" in r]
    assert frozen == [1.0, 1.0, 0.0, 0.0]


def test_the_hook_keeps_the_best_eval_loss(tmp_path: Path) -> None:
    hook = example("hook").BestEvalLoss()
    run = tmp_path / "run"
    outcome = run_training(settings(run, "--train.max_steps=6", "--eval.interval=2", "--eval.steps=2"), hooks=[hook])
    assert outcome.status == "completed"
    evals = [(r["step"], r["eval_loss"]) for r in records(run) if "eval_loss" in r]
    assert len(evals) == 3
    best_step, best = min(evals, key=lambda e: e[1])
    assert json.loads((run / "best_eval.json").read_text()) == {"step": best_step, "eval_loss": best}
    logged = [r["eval/best_loss"] for r in records(run) if "eval/best_loss" in r]
    assert logged[-1] == best and logged == sorted(logged, reverse=True)


def test_the_model_family_trains_through_the_recipe(tmp_path: Path) -> None:
    family = example("model_family")
    seen: list[str] = []

    def build(s: JobSettings, runtime: Any) -> Any:
        model, pipeline = family.build_gpt2_like(s, runtime)
        seen.append(type(model).__name__)
        return model, pipeline

    run = tmp_path / "run"
    outcome = run_training(settings(run, "--train.max_steps=20", "--optimizer.lr=3e-3"), model=build)
    assert outcome.status == "completed" and seen == ["GPT2Like"]
    losses = [r["loss"] for r in records(run) if "loss" in r]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # it learns (from ~ln 320 = 5.8)
    assert (run / "checkpoints" / "step_20").is_dir()  # and checkpoints like a kforge model


def test_the_tracker_backend_receives_every_metric_point(tmp_path: Path) -> None:
    tracker = example("tracker_backend").tracker_with_csv
    run = tmp_path / "run"
    outcome = run_training(settings(run, "--train.max_steps=3"), tracker=tracker)
    assert outcome.status == "completed"
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    csv_losses = {int(r["step"]): float(r["value"]) for r in rows if r["key"] == "loss"}
    jsonl_losses = {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert csv_losses == pytest.approx(jsonl_losses) and sorted(csv_losses) == [1, 2, 3]
    assert any(r["key"] == "checkpoint_step" and r["step"] == "3" for r in rows)  # the final save


def test_the_loop_component_example_is_kforges_own_file_and_stops_a_run_as_a_hook(tmp_path: Path) -> None:
    from kforge_cli.engine.train.components import early_stop, selection

    page = (Path(__file__).parents[2] / "docs" / "extending.md").read_text()
    assert '--8<-- "early_stop.py"' in page  # the page shows the shipped file (mkdocs snippets base_path)
    registration = (
        "        components.append(EarlyStop(settings.train.early_stop_patience, settings.train.early_stop_min_delta))"
    )
    assert registration in page and registration in Path(selection.__file__).read_text()
    run = tmp_path / "run"
    hook = early_stop.EarlyStop(patience=1, min_delta=100.0)  # nothing counts as better: stop at the 2nd eval
    outcome = run_training(settings(run, "--train.max_steps=6", "--eval.interval=2", "--eval.steps=1"), hooks=[hook])
    assert outcome.status == "early_stop" and outcome.step == 4
    assert [r["step"] for r in records(run) if "early_stop" in r] == [4]
