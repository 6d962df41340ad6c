"""Weights & Biases backend: one W&B run per kforge run, continued across requeues.

The run id is chosen here (not by W&B) so that it is known even when ``wandb.init``
fails; it goes into every checkpoint and the resumed job calls ``wandb.init(id=...,
resume="allow")``, so the requeued job continues the same run.

Clusters often have no API key or no route to the internet. With ``metrics.wandb_mode
= "auto"`` the run is then logged offline, the log says why and which directory to
``wandb sync`` later; an online start that fails falls back to offline the same way.

``wandb`` is imported inside :meth:`WandbBackend.start` so that importing the observe
package stays cheap.
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import socket
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kforge_cli.common.files import real_dir
from kforge_cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_REQUEUE
from kforge_cli.settings.infrastructure import MetricsSettings

if TYPE_CHECKING:
    from kforge_cli.engine.observe.tracking_types import CheckpointMark, MetricPoints, RunInfo, TrackerStatus

log = logging.getLogger("kforge")

DEFAULT_BASE_URL = "https://api.wandb.ai"
WANDB_EXIT_CODES: dict[str, int] = {"completed": EXIT_OK, "stopped": EXIT_REQUEUE, "failed": EXIT_FAILURE}
_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_run_id() -> str:
    """A fresh W&B run id (8 characters, like W&B's own)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def has_api_key(base_url: str, env: dict[str, str] | None = None) -> bool:
    """Whether W&B would find credentials: ``WANDB_API_KEY``, an identity token file, or a netrc entry."""
    env = dict(os.environ) if env is None else env
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(base_url).hostname or ""
    path = Path(env["NETRC"]) if env.get("NETRC") else Path(env.get("HOME", str(Path.home()))) / ".netrc"
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def can_reach(base_url: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the W&B server opens within ``timeout_s``."""
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def choose_mode(setting: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``(mode, why)`` for ``wandb.init``: the setting, else ``$WANDB_MODE``, else key and network decide."""
    env = dict(os.environ) if env is None else env
    if setting != "auto":
        return setting, f"metrics.wandb_mode = {setting!r}"
    if env.get("WANDB_MODE"):
        mode = env["WANDB_MODE"]
        return ("offline" if mode == "dryrun" else mode), f"WANDB_MODE={mode}"
    base_url = env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    if not has_api_key(base_url, env):
        return "offline", "no W&B API key (set WANDB_API_KEY or run `wandb login`)"
    if not can_reach(base_url):
        return "offline", f"cannot reach {base_url}"
    return "online", f"API key found and {base_url} reachable"


class WandbBackend:
    """One W&B run; ``wandb.run`` is set, so a hook can log to the same run with ``wandb.log``."""

    name = "wandb"

    def __init__(self, settings: MetricsSettings, info: RunInfo, run_id: str | None = None) -> None:
        self.run_id: str | None = run_id or new_run_id()  # never None here; typed as the protocol says
        self.continuing = run_id is not None
        self.mode: str | None = None
        self.sync_dir: Path | None = None
        self._settings = settings
        self._info = info
        self._run: Any = None
        self._first_step = 0  # a resumed online run refuses steps below the ones it has

    def start(self) -> None:
        import wandb

        mode, why = choose_mode(self._settings.wandb_mode)
        m, info = self._settings, self._info
        kwargs: dict[str, Any] = {
            "project": m.wandb_project,
            "entity": m.wandb_entity,
            "name": info.name,
            "group": m.wandb_group,
            "tags": list(info.tags),
            "config": info.config,
            "id": self.run_id,
            "resume": "allow",
            "allow_val_change": True,  # a resumed run may differ in e.g. metrics.wandb_run_id
            # WANDB_DIR wins; else the run's files go under RUN_DIR/wandb, not the working directory.
            "dir": None if os.environ.get("WANDB_DIR") else str(info.run_dir),
        }
        if not os.environ.get("WANDB_DIR"):
            real_dir(info.run_dir / "wandb")  # a planted RUN_DIR/wandb link is refused, never written through
        try:
            run = wandb.init(mode=mode, **kwargs)  # pyright: ignore[reportArgumentType]
        except Exception as exc:
            if mode != "online":
                raise
            log.warning("wandb: could not start online (%s: %s); logging offline instead", type(exc).__name__, exc)
            mode, why = "offline", "the online start failed"
            run = wandb.init(mode=mode, **kwargs)  # pyright: ignore[reportArgumentType]
        self._run, self.mode = run, mode
        self._first_step = int(run.step) if run.resumed and mode == "online" else 0
        verb = "continuing" if self.continuing else "started"
        if mode == "offline":
            self.sync_dir = Path(run.dir).parent
            log.warning(
                "wandb: logging OFFLINE (%s): %s run %s in %s; upload it later with `wandb sync %s`",
                why,
                verb,
                run.id,
                self.sync_dir,
                self.sync_dir,
            )
        else:
            log.info("wandb: %s run %s (%s): %s", verb, run.id, why, getattr(run, "url", None))

    def log_metrics(self, batch: Sequence[MetricPoints]) -> None:
        for points in batch:
            if points.step >= self._first_step:
                self._run.log(dict(points.values), step=points.step)

    def log_checkpoint(self, mark: CheckpointMark) -> None:
        if mark.step >= self._first_step:
            self._run.log({"checkpoint_step": mark.step}, step=mark.step)
        self._run.summary.update({"last_checkpoint": mark.path, "last_checkpoint_step": mark.step})

    def finish(self, status: TrackerStatus) -> None:
        if status == "stopped":
            self._run.mark_preempting()  # W&B shows it as preempted; the requeued job continues it
        self._run.finish(exit_code=WANDB_EXIT_CODES[status])
        if self.sync_dir is not None:
            log.info("wandb: offline run %s saved; upload it with `wandb sync %s`", self.run_id, self.sync_dir)
