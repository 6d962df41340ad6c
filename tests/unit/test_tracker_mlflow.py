"""engine.observe.mlflow_backend against a real local MLflow store (``sqlite:///``, in process).

The tracking-server path (HTTP, SIGTERM and resume through a checkpoint, a server that
dies mid-run) is in tests/e2e/test_tracking_mlflow.py.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kforge_cli.engine.observe import shutdown_logging
from kforge_cli.engine.observe.mlflow_backend import (
    MAX_PARAM_VALUE_LENGTH,
    TRUNCATED,
    MlflowBackend,
    flatten_params,
    local_artifact_root,
    metric_key,
    resolve_tracking_uri,
)
from kforge_cli.engine.observe.tracker import CheckpointMark, MetricPoints, RunInfo
from kforge_cli.engine.train import TrainHook, run_training
from kforge_cli.errors import ConfigError, InvalidInputError
from kforge_cli.settings import JobSettings, load_settings
from kforge_cli.settings.explain import to_toml
from kforge_cli.settings.infrastructure import MetricsSettings

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: seen.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kforge")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def db_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sqlite store for the module: creating its tables takes seconds."""
    return tmp_path_factory.mktemp("mlflow_db")


def job(tmp_path: Path, db_dir: Path, experiment: str, max_steps: int = 7) -> tuple[MetricsSettings, RunInfo]:
    settings = JobSettings()
    settings.train.max_steps = max_steps
    settings.metrics.tags = ["team=nlp", "baseline"]
    settings.metrics.mlflow_tracking_uri = f"sqlite:///{db_dir / 'mlflow.db'}"
    settings.metrics.mlflow_experiment = experiment
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(settings))
    config = settings.model_dump(mode="json")
    info = RunInfo(
        "unit-run", settings.metrics.tags, "cpu-debug", 4, "a" * 40, run_dir, config, run_dir / "config.toml"
    )
    return settings.metrics, info


def test_flatten_params_follows_mlflow_limits() -> None:
    config = {
        "a": {"b": 1, "c": {"d": [1, 2]}, "e": None, "f": {}},
        "s": "x" * 7000,
        "t": True,
        "lr": 3e-4,
        "metrics": {"mlflow_run_id": "r", "wandb_run_id": "w", "tags": []},
    }
    params = flatten_params(config)
    assert params == {
        "a.b": "1",
        "a.c.d": "[1, 2]",
        "a.e": "null",
        "a.f": "{}",
        "s": "x" * (MAX_PARAM_VALUE_LENGTH - len(TRUNCATED)) + TRUNCATED,
        "t": "true",
        "lr": "0.0003",
        "metrics.tags": "[]",
    }
    assert len(params["s"]) == MAX_PARAM_VALUE_LENGTH
    assert metric_key("loss/train (ema)") == "loss/train _ema_"


def test_file_stores_are_refused_and_sqlite_artifacts_sit_next_to_the_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bad in ("./mlruns", "/abs/mlruns", "file:///abs/mlruns"):
        with pytest.raises(InvalidInputError, match="plain file store"):
            resolve_tracking_uri(bad)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert resolve_tracking_uri(None) == "http://tracker:5000"
    assert resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mlruns")
    with pytest.raises(InvalidInputError, match="MLFLOW_TRACKING_URI"):
        resolve_tracking_uri(None)
    assert local_artifact_root(f"sqlite:///{tmp_path}/m.db") == (tmp_path / "mlartifacts").as_uri()
    assert local_artifact_root("http://host:5000") is None


def test_a_database_store_without_the_full_mlflow_is_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """kforge depends on mlflow-skinny; sqlite (MLflow's default store) needs sqlalchemy/alembic from full mlflow."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"  # full mlflow (dev) installed here
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # find_spec -> None: as with mlflow-skinny alone
    for uri, said in (("sqlite:///x.db", "'sqlite:///x.db' is a database store"), (None, "is not set")):
        with pytest.raises(InvalidInputError, match="metrics.mlflow_tracking_uri") as err:
            resolve_tracking_uri(uri)
        assert said in str(err.value) and "kforge[mlflow-server]" in str(err.value)
    assert resolve_tracking_uri("http://tracker:5000") == "http://tracker:5000"
    mlflow_on = ["--metrics.backends=['jsonl', 'mlflow']"]
    with pytest.raises(ConfigError) as cfg:
        load_settings(overrides=[*mlflow_on, "--metrics.mlflow_tracking_uri=postgresql+psycopg2://h/db"], for_run=True)
    assert [i.path for i in cfg.value.issues] == ["metrics.mlflow_tracking_uri"]
    load_settings(overrides=[*mlflow_on, "--metrics.mlflow_tracking_uri=https://h"], for_run=True)
    load_settings(overrides=["--metrics.mlflow_tracking_uri=sqlite:///x.db"], for_run=True)  # mlflow not a backend


def test_run_is_logged_stopped_and_continued_as_one_run(tmp_path: Path, db_dir: Path, warnings_seen: list[str]) -> None:
    metrics_settings, info = job(tmp_path, db_dir, "continued")
    first = MlflowBackend(metrics_settings, info)
    first.start()
    run_id = first.run_id
    assert run_id is not None
    first.log_metrics([MetricPoints(1, {"loss": 2.5, "lr": 0.1}, 1000.0), MetricPoints(2, {"loss": 2.0}, 1001.0)])
    first.log_checkpoint(CheckpointMark(2, str(tmp_path / "ckpt" / "step_2"), 1002.0))
    first.finish("stopped")

    client = mlflow.MlflowClient(metrics_settings.mlflow_tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "unit-run"
    expected = flatten_params(info.config)
    assert run.data.params == expected and expected["train.max_steps"] == "7"
    assert expected["optimizer.betas"] == "[0.9, 0.95]" and "metrics.mlflow_run_id" not in expected
    tags = run.data.tags
    assert (tags["profile"], tags["world_size"], tags["git_commit"]) == ("cpu-debug", "4", "a" * 40)
    assert (tags["team"], tags["baseline"], tags["kforge.last_checkpoint_step"]) == ("nlp", "true", "2")
    assert [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, "loss")] == [
        (1, 2.5, 1_000_000),
        (2, 2.0, 1_001_000),
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "checkpoint_step")] == [(2, 2.0)]
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(db_dir / "mlartifacts")
    assert (artifacts / "config.toml").read_text() == info.config_path.read_text()

    # The requeued job: same run id, one config value changed on its command line.
    metrics_settings, info = job(tmp_path, db_dir, "continued", max_steps=9)
    second = MlflowBackend(metrics_settings, info, run_id=run_id)
    second.start()
    assert second.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    assert any("train.max_steps ('7' -> '9')" in w and "immutable" in w for w in warnings_seen)
    second.log_metrics([MetricPoints(3, {"loss": 1.5}, 1003.0)])
    second.finish("completed")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "7"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
    experiment = client.get_experiment_by_name("continued")
    assert experiment is not None
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]


def test_unknown_run_id_starts_a_new_run_with_a_warning(tmp_path: Path, db_dir: Path, warnings_seen: list[str]) -> None:
    metrics_settings, info = job(tmp_path, db_dir, "unknown-id")
    backend = MlflowBackend(metrics_settings, info, run_id="0" * 32)
    backend.start()
    assert backend.run_id is not None and backend.run_id != "0" * 32
    backend.finish("failed")
    client = mlflow.MlflowClient(metrics_settings.mlflow_tracking_uri)
    assert client.get_run(backend.run_id).info.status == "FAILED"
    assert any("does not exist" in w for w in warnings_seen)


class FailAtStep2(TrainHook):
    def on_step_end(self, session: Any, info: Any) -> None:
        if info.step == 2:
            raise RuntimeError("boom at step 2")


def test_training_that_raises_closes_the_mlflow_run_as_failed(tmp_path: Path, db_dir: Path) -> None:
    uri = f"sqlite:///{db_dir / 'mlflow.db'}"
    settings = load_settings(
        overrides=[
            "--model.dim=32",
            "--model.n_layers=1",
            "--model.n_heads=2",
            "--model.n_kv_heads=1",
            "--model.vocab_size=320",
            "--train.batch_size=2",
            "--train.seq_len=16",
            "--train.max_steps=5",
            "--scheduler.warmup_steps=1",
            "--eval.interval=0",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            "--metrics.log_interval=1",
            "--metrics.progress_bar=off",
            '--metrics.backends=["jsonl","mlflow"]',
            f"--metrics.mlflow_tracking_uri={uri}",
            "--metrics.mlflow_experiment=raises",
            f"--train.run_dir={tmp_path / 'run'}",
        ]
    ).settings
    try:
        with pytest.raises(RuntimeError, match="boom at step 2"):
            run_training(settings, hooks=[FailAtStep2()])
    finally:
        shutdown_logging()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("raises")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
