"""Someone else's tracker settings (issue 29, class 5).

`kforge eval` reads a run; its config.toml names trackers (a sqlite MLflow URI anywhere, an
online W&B entity) that may be someone else's. By default eval logs nowhere: no tracker is
contacted, no file appears at the URI, metrics.jsonl is untouched. With `--track` it adds
its points to the training's own MLflow run, whose status (RUNNING while training goes on)
it never changes: only the run's training process ends its tracked run.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import tomli_w

from kforge_cli.cli.app import main
from tests.unit.test_eval import TINY, _task_file

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A finished tiny run tracked in a sqlite MLflow store: (run dir, tracking uri, MLflow run id)."""
    from kforge_cli.engine.train import run_training
    from kforge_cli.settings import load_settings

    root = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{root / 'store' / 'mlflow.db'}"
    (root / "store").mkdir()
    overrides = [
        *TINY,
        f"--train.run_dir={root / 'run'}",
        '--metrics.backends=["jsonl","mlflow"]',
        f"--metrics.mlflow_tracking_uri={uri}",
        "--metrics.mlflow_experiment=hostile",
    ]
    assert run_training(load_settings(overrides=overrides, use_env=False).settings).status == "completed"
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("hostile")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    return root / "run", uri, run.info.run_id


def _eval(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(["eval", *args])
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out + out.err


def test_eval_logs_nowhere_unless_asked(
    tracked_run: tuple[Path, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _, _ = tracked_run
    config = run / "config.toml"
    original = config.read_text()
    outside = tmp_path / "not" / "yours" / "mlflow.db"  # a colleague's config points the tracker elsewhere
    data = tomllib.loads(original)
    data["metrics"]["mlflow_tracking_uri"] = f"sqlite:///{outside}"
    config.write_text(tomli_w.dumps(data))
    metrics_before = (run / "metrics.jsonl").read_bytes()
    try:
        code, out = _eval(capsys, str(run), "--task", str(_task_file(tmp_path)))
    finally:
        config.write_text(original)
    assert code == 0, out
    assert not (tmp_path / "not").exists()  # no file, no parent directory outside the run
    assert (run / "metrics.jsonl").read_bytes() == metrics_before
    assert "logged at step" not in out


def test_eval_track_adds_points_but_never_ends_the_live_run(
    tracked_run: tuple[Path, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, uri, run_id = tracked_run
    client = mlflow.MlflowClient(uri)
    client.update_run(run_id, status="RUNNING")  # as while its training job still runs
    lines_before = len((run / "metrics.jsonl").read_text().splitlines())
    code, out = _eval(capsys, str(run), "--task", str(_task_file(tmp_path)), "--track")
    assert code == 0, out
    assert client.get_run(run_id).info.status == "RUNNING"  # not FINISHED: training goes on
    history = client.get_metric_history(run_id, "eval/tiny_mc/acc")
    assert [m.step for m in history] == [3]
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == lines_before + 1 and "eval/tiny_mc/acc" in json.loads(rows[-1])
    client.set_terminated(run_id, status="KILLED")  # a stopped run stays stopped too
    code, out = _eval(capsys, str(run), "--task", str(_task_file(tmp_path)), "--track")
    assert code == 0 and client.get_run(run_id).info.status == "KILLED", out
