"""MLflow backend: one MLflow run per kforge run, continued across requeues.

The run id is created by the tracking server, reported through ``Tracker.run_ids`` into
every checkpoint, and handed back on resume: the resumed job reopens the same run
(status back to RUNNING), adds the params it did not have and keeps logging metrics by
step. At the end the run is marked FINISHED, KILLED (stopped by a signal, to be
requeued) or FAILED.

Params are the flattened resolved config. MLflow params are immutable and limited in
length, so values are truncated to MLflow's limit and a value that differs on resume is
reported rather than sent (sending it would fail the whole batch). The two run-id
settings are not params: they identify the run and change when a run is continued.

``mlflow`` is imported inside :meth:`MlflowBackend.start` so that importing the observe
package stays cheap.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.infrastructure import MetricsSettings
from kforge_cli.settings.tracking_check import mlflow_store_issue

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

    from kforge_cli.engine.observe.tracking_types import CheckpointMark, MetricPoints, RunInfo, TrackerStatus

log = logging.getLogger("kforge")

MLFLOW_STATUS: dict[str, str] = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
NOT_PARAMS = frozenset({"metrics.mlflow_run_id", "metrics.wandb_run_id"})
MAX_PARAM_VALUE_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_KEY_LENGTH = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_TAG_VALUE_LENGTH = 8000
PARAMS_PER_BATCH = 100
TRUNCATED = "...[truncated]"
_INVALID_KEY_CHARS = re.compile(r"[^\w\-. /:]")

# The client's own defaults retry a failed request for minutes (7 retries, backoff 2 s)
# while training waits; the tracker retries at later writes instead. A user's own
# environment variables win.
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # the kforge log says where the run is
}


def param_value(value: object) -> str:
    """A param's text: strings as they are, anything else as JSON; cut to MLflow's limit."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_PARAM_VALUE_LENGTH:
        text = text[: MAX_PARAM_VALUE_LENGTH - len(TRUNCATED)] + TRUNCATED
    return text


def flatten_params(config: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 0.1}}`` -> ``{"train.lr": "0.1"}`` (lists and empty tables as JSON)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(flatten_params(value, dotted + "."))
        elif dotted not in NOT_PARAMS:
            params[dotted] = param_value(value)
    return params


def metric_key(name: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . / :`` and spaces)."""
    return _INVALID_KEY_CHARS.sub("_", name)[:MAX_KEY_LENGTH]


def resolve_tracking_uri(configured: str | None) -> str | None:
    """``metrics.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else MLflow's default (None).

    Raises a clear error for a plain file store: MLflow 3 keeps it in maintenance mode
    and refuses to create runs there, which would otherwise surface only as a warning
    after the model is built; and for a database store (MLflow's default) when only the
    mlflow-skinny client is installed.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or None
    if uri is not None and urlsplit(uri).scheme in ("", "file"):
        source = "metrics.mlflow_tracking_uri" if configured else "MLFLOW_TRACKING_URI"
        raise InvalidInputError(
            f"{source} = {uri!r} is a plain file store, which MLflow 3 refuses (maintenance mode): use a "
            "database such as 'sqlite:///path/to/mlflow.db' or a tracking server URL such as 'http://host:5000'"
        )
    issue = mlflow_store_issue(configured, os.environ.get("MLFLOW_TRACKING_URI"))
    if issue is not None:  # also checked with the settings (kforge train), this covers direct use
        raise InvalidInputError(str(issue))
    return uri


def local_artifact_root(uri: str) -> str | None:
    """Artifacts of a local ``sqlite:///`` store go next to the database, not into the working directory."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return (Path(path).resolve().parent / "mlartifacts").as_uri()


def run_tags(info: RunInfo) -> dict[str, str]:
    """Profile, world size, run dir, git commit, and ``metrics.tags`` (``key=value`` or a bare name)."""
    tags = {
        "profile": info.profile or "custom",
        "world_size": str(info.world_size),
        "kforge.run_dir": str(info.run_dir),
    }
    if info.git_commit:
        tags["git_commit"] = info.git_commit
        tags["mlflow.source.git.commit"] = info.git_commit  # shown by the MLflow UI
    for tag in info.tags:
        key, sep, value = tag.partition("=")
        tags[metric_key(key.strip())] = value.strip()[:MAX_TAG_VALUE_LENGTH] if sep else "true"
    return tags


class MlflowBackend:
    """One MLflow run through ``MlflowClient`` (no global ``mlflow.active_run`` state)."""

    name = "mlflow"

    def __init__(self, settings: MetricsSettings, info: RunInfo, run_id: str | None = None) -> None:
        self.run_id = run_id
        self._uri = resolve_tracking_uri(settings.mlflow_tracking_uri)
        self._experiment = settings.mlflow_experiment
        self._info = info
        self._client: MlflowClient | None = None
        # True for `kforge eval --track`: add points to the training run that exists, never create a run,
        # touch its status, params or tags (only the run's own training process starts and ends it)
        self.attach_only = False

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            raise RuntimeError("MlflowBackend.start() has not succeeded yet")
        return self._client

    def start(self) -> None:
        for key, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient

        if self._client is None:
            self._client = MlflowClient(tracking_uri=self._uri)
        client = self._client
        run = self._existing_run(client) if self.run_id else None
        if self.attach_only:
            if run is None:
                raise RuntimeError("the run has no MLflow run to add to (kforge eval never creates one)")
            log.info("mlflow: adding to run %s (its status is left to its training job)", run.info.run_id)
            return
        if run is None:
            run = client.create_run(self._experiment_id(client), run_name=self._info.name)
            self.run_id = run.info.run_id
            verb = "started"
        else:
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
            verb = "continuing"
        run_id = run.info.run_id
        self._log_params(client, run_id, dict(run.data.params))
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in run_tags(self._info).items()])
        if self._info.config_path.is_file():
            client.log_artifact(run_id, str(self._info.config_path))
        log.info("mlflow: %s run %s (experiment %r) at %s", verb, run_id, self._experiment, self._run_url(run))

    def _run_url(self, run: Run) -> str:
        uri = self.client.tracking_uri
        if urlsplit(uri).scheme in ("http", "https"):
            return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        return uri

    def _existing_run(self, client: MlflowClient) -> Run | None:
        from mlflow.exceptions import MlflowException

        assert self.run_id is not None
        try:
            run = client.get_run(self.run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("mlflow: run %s does not exist at %s; starting a new run", self.run_id, client.tracking_uri)
            return None
        if run.info.lifecycle_stage == "deleted":
            log.warning("mlflow: run %s was deleted; starting a new run", self.run_id)
            return None
        return run

    def _experiment_id(self, client: MlflowClient) -> str:
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(self._experiment)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(
                self._experiment, artifact_location=local_artifact_root(client.tracking_uri)
            )
        except MlflowException as exc:  # another job created it first
            experiment = client.get_experiment_by_name(self._experiment)
            if experiment is None:
                raise exc from None
            return experiment.experiment_id

    def _log_params(self, client: MlflowClient, run_id: str, existing: dict[str, str]) -> None:
        from mlflow.entities import Param

        wanted = flatten_params(self._info.config)
        changed = sorted(k for k, v in wanted.items() if k in existing and existing[k] != v)
        if changed:
            shown = ", ".join(f"{k} ({existing[k]!r} -> {wanted[k]!r})" for k in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            log.warning(
                "mlflow: %d config value(s) differ from the params this run already has and are not updated "
                "(MLflow params are immutable): %s%s",
                len(changed),
                shown,
                more,
            )
        new = [Param(k, v) for k, v in wanted.items() if k not in existing and len(k) <= MAX_KEY_LENGTH]
        for i in range(0, len(new), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=new[i : i + PARAMS_PER_BATCH])

    def log_metrics(self, batch: Sequence[MetricPoints]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(metric_key(key), value, int(p.time * 1000), p.step) for p in batch for key, value in p.values.items()
        ]
        if metrics:
            self.client.log_batch(self._require_run(), metrics=metrics)

    def log_checkpoint(self, mark: CheckpointMark) -> None:
        from mlflow.entities import Metric, RunTag

        self.client.log_batch(
            self._require_run(),
            metrics=[Metric("checkpoint_step", float(mark.step), int(mark.time * 1000), mark.step)],
            tags=[RunTag("kforge.last_checkpoint", mark.path), RunTag("kforge.last_checkpoint_step", str(mark.step))],
        )

    def finish(self, status: TrackerStatus) -> None:
        self.client.set_terminated(self._require_run(), status=MLFLOW_STATUS[status])
        log.info("mlflow: run %s marked %s", self.run_id, MLFLOW_STATUS[status])

    def _require_run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("the MLflow run has not been created yet")
        return self.run_id
