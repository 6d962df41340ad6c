"""Tracker settings against the installed packages, before the model is built.

The default job logs to metrics.jsonl only, so the trackers' packages are extras: a backend
in ``metrics.backends`` whose package is not installed is an exit 2 naming the exact install
command (``pip install 'kforge[wandb]'``, ``'kforge[mlflow]'``, ``'kforge[tensorboard]'``).
The ``mlflow`` extra is ``mlflow-skinny`` (the client: an HTTP tracking server is all it needs).
A database store (``sqlite:///...``, ``postgresql://...``), MLflow's own default when no URI is
set, is opened by the client itself through SQLAlchemy and Alembic, which only the full
``mlflow`` package brings (``pip install 'kforge[mlflow-server]'``). Checking for them here (by
module spec, nothing imported) turns a late ImportError into an exit 2 naming the setting.
"""

from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlsplit

from kforge_cli.errors import ConfigIssue
from kforge_cli.settings.infrastructure import MetricsSettings

MLFLOW_DEFAULT_URI = "sqlite:///mlflow.db"  # what MLflow 3 uses when nothing is set
DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
FULL_MLFLOW_MODULES = ("sqlalchemy", "alembic")
INSTALL_HINT = "pip install 'kforge[mlflow-server]'"


def is_database_uri(uri: str) -> bool:
    """``sqlite:///x.db``, ``postgresql+psycopg2://...`` and the like."""
    return urlsplit(uri).scheme.split("+", 1)[0] in DB_SCHEMES


def missing_full_mlflow() -> list[str]:
    """The modules a database store needs that are not installed (empty with the full mlflow)."""
    return [name for name in FULL_MLFLOW_MODULES if importlib.util.find_spec(name) is None]


def mlflow_store_issue(configured: str | None, env_uri: str | None = None) -> ConfigIssue | None:
    """An issue when the URI names a database store (or none, i.e. MLflow's sqlite default) without full mlflow."""
    uri = configured or env_uri or None
    if uri is not None and not is_database_uri(uri):
        return None
    missing = missing_full_mlflow()
    if not missing:
        return None
    if uri is None:
        what = f"is not set (nor MLFLOW_TRACKING_URI), so MLflow would use its default {MLFLOW_DEFAULT_URI!r}"
    elif configured:
        what = f"{uri!r} is a database store"
    else:
        what = f"is not set and MLFLOW_TRACKING_URI = {uri!r} is a database store"
    return ConfigIssue(
        "metrics.mlflow_tracking_uri",
        f"{what}, which needs the full mlflow package ({', '.join(missing)} not installed; kforge[mlflow] installs only "
        f"the mlflow-skinny client): run `{INSTALL_HINT}`, or log to a tracking server with "
        "--metrics.mlflow_tracking_uri=http://HOST:5000",
    )


# backend -> (the module it imports, the extra that installs it)
BACKEND_PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "tensorboard": ("tensorboard", "tensorboard"),
}


def install_command(extra: str) -> str:
    """The exact command that installs kforge's `extra` (quoted for any shell)."""
    return f"pip install 'kforge[{extra}]'"


def missing_backend_issues(metrics: MetricsSettings) -> list[ConfigIssue]:
    """One issue per configured tracker whose package is not installed (by module spec: nothing imported)."""
    issues = []
    for backend in metrics.backends:
        module, extra = BACKEND_PACKAGES.get(backend, (None, ""))
        if module is not None and importlib.util.find_spec(module) is None:
            issues.append(
                ConfigIssue(
                    "metrics.backends",
                    f"{backend!r} needs the {module} package, which is not installed: run `{install_command(extra)}` "
                    f"(or drop {backend!r} from metrics.backends; metrics.jsonl is always written)",
                )
            )
    return issues


def tracking_issues(metrics: MetricsSettings) -> list[ConfigIssue]:
    """Problems of the configured trackers that the installed packages reveal."""
    issues = missing_backend_issues(metrics)
    if "mlflow" not in metrics.backends or issues:
        return issues
    issue = mlflow_store_issue(metrics.mlflow_tracking_uri, os.environ.get("MLFLOW_TRACKING_URI"))
    return [issue] if issue else []
