"""MLflow tracking for real: `kforge train` against an `mlflow server` started by the test run.

One server (sqlite backend, 127.0.0.1, a free port) serves the whole test session; it
takes a while to start. It runs in its own process group and is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.e2e.test_tracking_hooks import HOOKS, TINY, hook_env, numeric_metrics

pytestmark = pytest.mark.e2e
mlflow = pytest.importorskip("mlflow")


@dataclass
class MlflowServer:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(root: Path, timeout_s: float = 240) -> MlflowServer:
    """`mlflow server` from this venv on a sqlite store; returns once /health answers."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runners
    with (root / "server.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = MlflowServer(proc, port, root)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    stop_mlflow_server(server)
    pytest.fail(f"mlflow server not healthy after {timeout_s} s:\n{(root / 'server.log').read_text()[-3000:]}")


def stop_mlflow_server(server: MlflowServer) -> None:
    """SIGTERM the server's process group (its PID: it leads the group), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):  # already gone (the kill test's hook)
            os.killpg(server.proc.pid, sig)
        try:
            server.proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow_server"))
    try:
        yield server
    finally:
        stop_mlflow_server(server)


def read_jsonl(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def toml_params(table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """config.toml flattened the way the issue asks MLflow params to look (strings raw, the rest JSON)."""
    out: dict[str, str] = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            out.update(toml_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def test_preempted_and_requeued_job_is_one_mlflow_run(kforge, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    n = 4
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--run-dir",
        str(run_dir),
        f"--train.max_steps={2 * n}",
        "--eval.interval=3",
        "--eval.steps=2",
        "--checkpoint.interval=3",
        f'--train.hooks=["{HOOKS}:SigtermAt"]',
        '--metrics.backends=["jsonl","mlflow"]',
        f"--metrics.mlflow_tracking_uri={mlflow_server.uri}",
        "--metrics.mlflow_experiment=preempted",
        '--metrics.tags=["suite=e2e"]',
        *TINY,
    ]
    first = kforge(*args, cwd=REPO, env=hook_env(KFORGE_TEST_SIGTERM_AT=str(n)))
    assert first.returncode == 75, first.stderr[-3000:]
    client = mlflow.MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("preempted")
    assert experiment is not None
    (stopped,) = client.search_runs([experiment.experiment_id])
    run_id = stopped.info.run_id
    assert stopped.info.status == "KILLED"
    assert f"mlflow: started run {run_id}" in first.stderr

    second = kforge(*args, cwd=REPO, env=hook_env())  # the requeued job: same command, no explicit run id
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"mlflow: continuing run {run_id}" in second.stderr

    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    records = read_jsonl(run_dir)
    expected: dict[str, dict[int, float]] = {}  # metric -> step -> value; a redone step's later value wins
    for rec in records:
        for key, value in numeric_metrics(rec).items():
            expected.setdefault(key, {})[rec["step"]] = value
    assert sorted(expected["loss"]) == list(range(1, 2 * n + 1)) and sorted(expected["eval_loss"]) == [3, 6, 8]
    for key, by_step in expected.items():
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == sorted(by_step), key  # every logged step once, none missing
        for m in history:  # the client returns the stored doubles; allow only float-printing noise
            assert m.value == pytest.approx(by_step[m.step], rel=1e-12, abs=0.0), (key, m.step)
    checkpoints = [m.step for m in client.get_metric_history(run_id, "checkpoint_step")]
    assert n in checkpoints and 2 * n in checkpoints and checkpoints == sorted(set(checkpoints))

    config = tomllib.loads((run_dir / "config.toml").read_text())
    wanted = {k: v for k, v in toml_params(config).items() if not k.endswith("_run_id")}
    params = run.data.params
    assert {k: params.get(k) for k in wanted} == wanted
    assert wanted["train.max_steps"] == str(2 * n) and wanted["train.hooks"] == f'["{HOOKS}:SigtermAt"]'
    assert all(params[k] == "null" for k in set(params) - set(wanted))  # None: left out of the TOML

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    tags = run.data.tags
    assert (tags["profile"], tags["world_size"], tags["suite"]) == ("cpu-debug", "1", "e2e")
    assert tags.get("git_commit") == (commit or None)
    assert tags["kforge.last_checkpoint_step"] == str(2 * n)
    local = Path(client.download_artifacts(run_id, "config.toml", str(tmp_path / "download")))
    assert local.read_text() == (run_dir / "config.toml").read_text()


def test_tracking_server_killed_mid_run_does_not_stop_training(kforge, tmp_path: Path) -> None:
    kill_at, steps = 3, 7
    server = start_mlflow_server(tmp_path / "server")  # its own: this test kills it
    try:
        run_dir = tmp_path / "run"
        result = kforge(
            "train",
            "--run-dir",
            str(run_dir),
            f"--train.max_steps={steps}",
            "--eval.interval=0",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            f'--train.hooks=["{HOOKS}:KillServerAt"]',
            '--metrics.backends=["jsonl","mlflow"]',
            f"--metrics.mlflow_tracking_uri={server.uri}",
            *TINY,
            env=hook_env(
                KFORGE_TEST_KILL_AT=str(kill_at),
                KFORGE_TEST_KILL_PGID=str(server.proc.pid),
                KFORGE_TEST_KILL_PORT=str(server.port),
            ),
        )
    finally:
        stop_mlflow_server(server)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tracking server killed after step 3" in result.stderr
    assert f"training complete: {steps} steps" in result.stderr
    records = read_jsonl(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # metrics.jsonl has everything
    lost = sum(len(numeric_metrics(r)) for r in records if r["step"] > kill_at)
    assert lost > 0
    assert (
        f"mlflow: {lost} metric point(s) were not delivered ({lost} still buffered at exit, 0 dropped" in result.stderr
    )
    assert result.stderr.count("mlflow: tracking failed") == 1  # warned once, not once per step
    assert "could not mark the run as completed" in result.stderr
