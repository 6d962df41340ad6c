"""`CheckpointManager`: DCP save (sync or async), durable commit, `latest`, retention, restore.

A save writes, in order: every rank's RNG state and rank 0's ``train_state.json`` /
``metadata.json``; the DCP shards and ``.metadata`` (DCP writes ``.metadata`` after all
ranks of the stage wrote their shards); then, once every rank has finished, rank 0
writes ``kforge_commit.json``, swaps ``latest`` and applies retention. A process killed
at any moment leaves either a complete checkpoint or a directory resume skips.
At most one save is in flight: a new save first waits for the previous one (the wait is
logged and recorded), so the async staging buffers (allocated once, see
``staging.HostStager``) are never refilled while they are being written.
Every save ends in one metrics record (``report``: bytes, seconds, MB/s, loop blocked).
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save, save

from kforge_cli.common.files import real_dir
from kforge_cli.engine.checkpoint.dcp_io import (
    quiet_single_process,
    shard_writer,
    state_nbytes,
    training_state_dict,
)
from kforge_cli.engine.checkpoint.disk_full import disk_full_explained
from kforge_cli.engine.checkpoint.groups import CheckpointGroups
from kforge_cli.engine.checkpoint.resolve import data_phase, freeze_config
from kforge_cli.engine.checkpoint.restore import CheckpointedState, HFLoader, Restored, RunParts, restore_run
from kforge_cli.engine.checkpoint.staging import HostStager
from kforge_cli.engine.checkpoint.train_state import FORMAT, write_rank_state
from kforge_cli.engine.model.module_names import clean_param_name
from kforge_cli.engine.model.vlm.freeze import freeze_record
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.rundir.checkpoints import atomic_write_json, prune, remove_checkpoint, step_dir_name, write_latest
from kforge_cli.rundir.fingerprint import fingerprint, shaping_config
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.names import COMMIT_FILE, DCP_METADATA, SUMMARY_FILE, TRAIN_STATE_FILE
from kforge_cli.settings import JobSettings
from kforge_cli.version import __version__

log = logging.getLogger("kforge")


@dataclass
class SaveRecord:
    """One save as this rank saw it (the benchmark and logs read these)."""

    step: int
    reason: str
    mode: Literal["sync", "async"]
    nbytes: int  # this rank's tensor bytes
    blocking_s: float  # time the training loop was held (staging for async, everything for sync)
    total_s: float | None = None  # from start until durable on this rank (rank 0: committed)
    waited_s: float = 0.0  # part of blocking_s spent waiting for this save's background write

    def metrics(self) -> dict[str, object]:
        """The ``metrics.jsonl`` record of this save (rank 0's bytes and times)."""
        seconds = self.total_s or 0.0
        return {
            "step": self.step,
            "checkpoint/bytes": self.nbytes,
            "checkpoint/seconds": seconds,
            "checkpoint/mb_per_s": self.nbytes / 2**20 / seconds if seconds > 0 else None,
            "checkpoint/blocked_s": self.blocking_s,
            "checkpoint/waited_s": self.waited_s,
            "checkpoint/async": self.mode == "async",
        }


@dataclass
class _Pending:
    record: SaveRecord
    step_dir: Path
    future: Future[None]
    started: float


class CheckpointManager:
    """Saves and restores a run's full state; see the module docstring for the protocol."""

    def __init__(
        self,
        settings: JobSettings,
        runtime: RuntimeContext,
        run_dir: Path,
        parts: RunParts,
        *,
        groups: CheckpointGroups | None = None,
        hf_loader: HFLoader | None = None,
    ) -> None:
        """`parts` is everything a checkpoint holds: `restore` loads into it, `save` writes it."""
        self.settings, self.cfg, self.runtime = settings, settings.checkpoint, runtime
        self.root = RunDir(run_dir).checkpoint_root(settings)
        self.parts = parts
        self.groups = groups or CheckpointGroups.build(runtime)
        self.shaping = shaping_config(settings)
        self.fingerprint = fingerprint(self.shaping)
        self.checkpointed = CheckpointedState(
            settings=settings,
            groups=self.groups,
            root=self.root,
            fingerprint=self.fingerprint,
            shaping=self.shaping,
            parts=parts,
            hf_loader=hf_loader,
        )
        self.last_step: int | None = None  # newest step saved (in flight or durable) or restored
        self.history: list[SaveRecord] = []
        self.restored: Restored | None = None  # set by `restore`
        self._pending: _Pending | None = None
        if self.cfg.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            log.info("checkpoint.async_mode = async_with_pinned_mem without CUDA: staging in ordinary memory")
        self._stager: HostStager | None = None  # built at the first async save, reused after
        self.report: Callable[[dict[str, object]], None] | None = None  # receives SaveRecord.metrics() at commit
        if self.is_main:
            real_dir(self.root)  # never created or used through a planted link

    @property
    def is_main(self) -> bool:
        return self.groups.rank == 0

    # ---- restore -------------------------------------------------------------------------

    @property
    def restored_metrics_run_ids(self) -> dict[str, str]:
        """Tracker run ids (e.g. {"wandb": ..., "mlflow": ...}) of the resumed run; {} on a fresh start."""
        return dict(self.restored.metrics_run_ids) if self.restored is not None else {}

    def restore(self) -> Restored | None:
        """Resume or warm start per the settings (collective): model, optimizer, scheduler, train
        state, data position and every named part, as given at construction. None on a fresh start."""
        self.restored = restore_run(self.checkpointed)
        if self.restored is not None and self.restored.kind == "resume":
            self.last_step = self.restored.step
        return self.restored

    def rewind(self) -> Restored | None:
        """Restore this run's newest complete checkpoint into its pieces, in this process (collective):
        a rewind. An in-flight save is finished first. None when there is none."""
        self.wait()
        restored = restore_run(self.checkpointed, own_only=True)
        if restored is not None:
            self.last_step = restored.step
        return restored

    # ---- save ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """A scheduled save is due after optimizer step `step`."""
        return self.cfg.interval > 0 and step % self.cfg.interval == 0 and step != self.last_step

    def save_reason(self, step: int, ending: str | None = None) -> str | None:
        """Why to save after step ``step`` (None: no save). ``ending``: how the loop ends (``completed``:
        per ``checkpoint.save_final``; any other end always saves, so the run can be continued)."""
        if ending is None:
            return "interval" if self.due(step) else None
        if ending == "completed":
            return "final" if self.cfg.save_final else None
        return "signal" if ending == "stopped" else ending

    def save(
        self,
        step: int,
        *,
        reason: str = "interval",
        metrics_run_ids: dict[str, str] | None = None,
        blocking: bool | None = None,
    ) -> Path:
        """Save the state after optimizer step `step` (collective). `blocking=None` follows async_mode."""
        self.wait()
        started = time.perf_counter()
        step_dir = self.root / step_dir_name(step)
        self._prepare(step_dir)
        write_rank_state(step_dir, self.groups.rank)
        if self.is_main:
            self._write_global_state(step_dir, step, reason, metrics_run_ids or {})
        tensors = training_state_dict(self.parts.model, self.parts.optimizer)
        target = step_dir / f"pp_{self.groups.stage}" if self.groups.num_stages > 1 else step_dir
        use_async = (self.cfg.async_mode != "disabled") if blocking is None else not blocking
        record = SaveRecord(step, reason, "async" if use_async else "sync", state_nbytes(tensors), 0.0)
        no_dist = not self.groups.distributed
        if use_async:
            stager = self._async_stager(record.nbytes)
            with quiet_single_process():
                result = async_save(
                    tensors,
                    checkpoint_id=target,
                    storage_writer=shard_writer(target, self.cfg),
                    async_stager=stager,
                    process_group=self.groups.save,
                    no_dist=no_dist,
                )
            future = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
            record.blocking_s = time.perf_counter() - started
            self._pending = _Pending(record, step_dir, future, started)
        else:
            with quiet_single_process(), disk_full_explained(step_dir, self.root):
                save(
                    tensors,
                    storage_writer=shard_writer(target, self.cfg),
                    process_group=self.groups.save,
                    no_dist=no_dist,
                )
            self.groups.barrier()
            record.blocking_s = time.perf_counter() - started
            self._commit(step_dir, record, started)
        self.last_step = step
        self.history.append(record)
        return step_dir

    def _async_stager(self, nbytes: int) -> HostStager:
        """The one stager of this run; its buffers (one copy of this rank's state) are made at the first save."""
        if self._stager is None:
            pinned = self.cfg.async_mode == "async_with_pinned_mem" and torch.cuda.is_available()
            self._stager = HostStager(pinned)
            kind = "pinned host" if pinned else "host"
            log.info(
                "async checkpoints stage into %.1f MB of %s memory per rank, allocated once and reused",
                nbytes / 2**20,
                kind,
            )
        return self._stager

    @property
    def staged_nbytes(self) -> int:
        """Host bytes the async staging buffers hold (0 before the first async save)."""
        return self._stager.nbytes if self._stager is not None else 0

    def _prepare(self, step_dir: Path) -> None:
        if self.is_main:
            if step_dir.exists() or step_dir.is_symlink():  # a dangling step_N link too (exists() is False)
                log.warning("replacing the existing %s", step_dir)
                remove_checkpoint(step_dir)  # a link: only the link goes
            step_dir.mkdir(parents=True)
            for s in range(self.groups.num_stages if self.groups.num_stages > 1 else 0):
                (step_dir / f"pp_{s}").mkdir()
        self.groups.barrier()

    def _dcp_dir_names(self) -> list[str]:
        n = self.groups.num_stages
        return [f"pp_{s}" for s in range(n)] if n > 1 else ["."]

    def _frozen_params(self) -> list[str]:
        return [clean_param_name(name) for name, p in self.parts.model.named_parameters() if not p.requires_grad]

    def _write_global_state(self, step_dir: Path, step: int, reason: str, run_ids: dict[str, str]) -> None:
        progress = self.parts.train_state.state_dict()
        dims = asdict(self.runtime.dims)
        state = {
            "format": FORMAT,
            "step": step,
            "progress": progress,
            "scheduler": self.parts.scheduler.state_dict(),
            "parts": self.parts.named_states(),  # the update and the loop components, by name
            "data": self.parts.loader.state_dict() if self.parts.loader is not None else None,
            "data_phase": data_phase(self.settings, step),
            "freeze": freeze_config(self.settings),
            "freeze_effective": freeze_record(self.settings.vlm, step),  # VLM: specs frozen for the next update
            "frozen_params": self._frozen_params(),
            "metrics_run_ids": dict(run_ids),
            "fingerprint": self.fingerprint,
            "shaping": self.shaping,
            "world_size": self.groups.world_size,
            "mesh": dims,
            "load_path": self.cfg.load_path,
        }
        atomic_write_json(step_dir / TRAIN_STATE_FILE, state)
        summary = {
            "format": "kforge-checkpoint",
            "version": FORMAT,
            "step": step,
            "tokens_seen": progress.get("tokens_seen"),
            "reason": reason,
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "world_size": self.groups.world_size,
            "mesh": dims,
            "dcp_dirs": self._dcp_dir_names(),
            "fingerprint": self.fingerprint,
            "model": self.shaping,
            "profile": self.settings.profile,
            "kforge_version": __version__,
            "torch_version": torch.__version__,
        }
        atomic_write_json(step_dir / SUMMARY_FILE, summary)

    def _commit(self, step_dir: Path, record: SaveRecord, started: float) -> None:
        """Rank 0, after every rank finished: the commit marker, then `latest`, then retention."""
        if self.is_main:
            record_json = {
                "step": record.step,
                "dcp_dirs": self._dcp_dir_names(),
                "world_size": self.groups.world_size,
                "fingerprint": self.fingerprint,
            }
            atomic_write_json(step_dir / COMMIT_FILE, record_json)
            write_latest(self.root, step_dir)
            deleted = prune(self.root, self.cfg.keep_last_n, protect={step_dir})
            for d in deleted:
                log.info("retention: deleted %s", d)
        record.total_s = time.perf_counter() - started
        mb = record.nbytes / 2**20
        log.info(
            "checkpoint step %d (%s, %s): %.1f MB/rank in %.2f s, loop blocked %.2f s -> %s",
            record.step,
            record.reason,
            record.mode,
            mb,
            record.total_s,
            record.blocking_s,
            step_dir,
        )
        if self.report is not None:
            self.report(record.metrics())

    def _stages_written(self, step_dir: Path) -> bool:
        return all((step_dir / d / DCP_METADATA).is_file() for d in self._dcp_dir_names())

    def poll(self) -> None:
        """Commit a finished async save (non-blocking; call at step boundaries)."""
        p = self._pending
        if p is None or not p.future.done():
            return
        with disk_full_explained(p.step_dir, self.root):
            p.future.result()  # re-raise a failed background save
        if self.is_main and not self._stages_written(p.step_dir):
            return  # another pipeline stage is still writing; try again next step
        self._pending = None
        self._commit(p.step_dir, p.record, p.started)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is durable (collective)."""
        p = self._pending
        if p is None:
            return
        self._pending = None
        t0 = time.perf_counter()
        with disk_full_explained(p.step_dir, self.root):
            p.future.result()
        self.groups.barrier()
        waited = time.perf_counter() - t0
        p.record.blocking_s += waited
        p.record.waited_s += waited
        if waited > 0.05:
            log.warning(
                "checkpoint: the loop waited %.2f s for the async save of step %d to finish writing "
                "(saves come faster than the disk takes them; raise checkpoint.interval to avoid it)",
                waited,
                p.record.step,
            )
        self._commit(p.step_dir, p.record, p.started)

    def close(self) -> None:
        """Finish an in-flight save without collectives (also on the failure path); free the staging buffers."""
        p, self._pending = self._pending, None
        try:
            if p is not None:
                self._finish_on_close(p)
        finally:
            if self._stager is not None:
                self._stager.close()  # frees the buffers; a write still running keeps its own references
                self._stager = None

    def _finish_on_close(self, p: _Pending) -> None:
        try:
            p.future.result(timeout=self.settings.distributed.timeout_s)
        except Exception as exc:  # the run is ending anyway: report, keep the previous checkpoint
            log.error(
                "async checkpoint of step %d did not finish (%s); the previous one stays latest", p.record.step, exc
            )
            return
        if not self.is_main or self._stages_written(p.step_dir):
            self._commit(p.step_dir, p.record, p.started)
