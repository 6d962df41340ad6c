"""What one optimizer step of a run read (`kforge data-trace`): each sample's dataset, shard, offset, length.

The data order is a pure function of the loader's position (`engine.data.sampler`), so the
step is replayed, not remembered: from the position recorded when the job (or loss-spike rewind)
that ran it began (`rundir.data_positions`), with the settings in force then (config.toml plus
the changes accepted until then, `rundir.saved_config`) and that job's batch size, accumulation
and number of data-parallel ranks, the loader's own arithmetic (`SampleOrder.advance`,
`SampleOrder.group_batch`) gives every rank's micro-batches. The samples are then located in the
prepared shards (`ShardedTokens.pieces`) and re-read for their document ends. No model, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kforge_cli.common.files import read_toml_file
from kforge_cli.common.json_values import int_of, list_of
from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.sampler import Cursor, SampleOrder
from kforge_cli.engine.data.sources import Source, training_sources
from kforge_cli.engine.data.tokens import ShardedTokens, Windows
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.checkpoints import newest_complete, step_of
from kforge_cli.rundir.data_positions import DataPosition, read_data_positions
from kforge_cli.rundir.launch import read_launch
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.metrics_tail import last_values
from kforge_cli.rundir.saved_config import apply_changes, read_changes
from kforge_cli.settings.job import JobSettings

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Piece:
    """Part of a sample stored contiguously: ``length`` tokens of ``shard`` from token ``offset``."""

    shard: str  # the shard's path ("" for the built-in corpus, which has none)
    offset: int
    length: int


@dataclass(frozen=True)
class SampleTrace:
    """One sample (one row of one rank's micro-batch): ``length`` = seq_len + 1 tokens of a dataset's
    train split from ``offset`` (inputs: the first seq_len, labels: the last seq_len)."""

    micro_batch: int
    rank: int  # data-parallel rank
    row: int  # row in that rank's micro-batch
    dataset: str
    window: int
    offset: int
    length: int
    pieces: list[Piece]
    document_ends: list[int]  # positions in the sample of end-of-document tokens
    text: str | None = None


@dataclass
class StepTrace:
    """Every sample of one step (or one rank's), and what the replay started from."""

    run_dir: str
    step: int
    trained: bool  # False: a step the run plans but has not reached yet
    seq_len: int
    batch_size: int  # per data-parallel rank and micro-batch
    dp_size: int
    grad_accum_steps: int
    world_size: int | None
    rank: int | None  # None: the whole global batch
    data_step: int  # the step the mixture's weights are taken at (differs from `step` after a rewind)
    global_sample: int  # position in the global sample stream of the step's first sample
    since: dict[str, object]  # the data_positions.jsonl record replayed from: step, reason, line (0: none)
    datasets: dict[str, str]  # name -> prepared directory (or "built-in corpus")
    samples: list[SampleTrace] = field(default_factory=list)
    rewinds: list[dict[str, object]] = field(default_factory=list)  # rewinds whose skipped window held this step

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _settings(raw: dict[str, object], changes: list[dict[str, object]], run: RunDir, count: int) -> JobSettings:
    try:
        return JobSettings.model_validate(apply_changes(raw, changes[:count]))
    except Exception as exc:  # pydantic's ValidationError: the run's files are the user's to fix
        raise InvalidInputError(
            f"{run.config} (+ {count} recorded changes) does not load as kforge settings ({exc})"
        ) from None


def _trained_steps(run: RunDir, settings: JobSettings) -> int:
    """How far the run trained: its newest complete checkpoint's step or the last logged, whichever is later
    (as ``kforge runs`` counts it; after a rewind the last logged step is where training is now)."""
    newest, _ = newest_complete(run.checkpoint_root(settings))
    done = (step_of(newest) or 0) if newest is not None else 0
    logged = last_values(run.metrics, ("loss",)).get("loss")
    return max(done, logged[0]) if logged is not None else done


def _legacy_start(run: RunDir, changes: list[dict[str, object]]) -> DataPosition:
    """A run from before data_positions.jsonl: one job from step 0 on its launch.json's mesh, when nothing
    changed since (otherwise the steps cannot be placed exactly: refused)."""
    launch = read_launch(run.path) or {}
    mesh = launch.get("mesh")
    if changes or not isinstance(mesh, dict):
        raise InvalidInputError(
            f"{run.path} has no {run.data_positions.name} (it was trained by a kforge from before data-trace) and "
            + ("its settings changed since it began" if changes else "no launch.json with its device mesh")
            + ": its steps' data cannot be traced exactly"
        )
    dp = int_of(mesh.get("dp_replicate", 1)) * int_of(mesh.get("dp_shard", 1))
    world = launch.get("world_size")
    return DataPosition(0, "start", 0, world if isinstance(world, int) else None, {"dp_size": dp}, 0)


def _check_data(source_names: list[str], windows: list[int], sources: list[Source], data: dict[str, object]) -> None:
    """The prepared data must be what the job read (its names, windows and fingerprints): else refused."""
    names = data.get("dataset_names", source_names)
    counts = data.get("dataset_windows", windows)
    prints = data.get("dataset_fingerprints")
    now = [s.fingerprint for s in sources]
    if names != source_names or counts != windows or (isinstance(prints, list) and prints != now):
        raise InvalidInputError(
            f"the training data changed since this step ran (then: datasets {names}, windows {counts}, "
            f"fingerprints {prints}; now: {source_names}, {windows}, {now}): the trace would not be what it read"
        )


def trace_step(run_dir: Path, step: int, *, rank: int | None = None, decode: bool = False) -> StepTrace:
    """Every sample step ``step`` of the run in ``run_dir`` read (only data-parallel rank ``rank``'s when given).

    Bad arguments (no such run, a step the run neither trained nor plans, a rank the step did not
    have) are `InvalidInputError` naming the argument.
    """
    run = RunDir(Path(run_dir).expanduser().resolve())
    if not run.has_config():
        raise InvalidInputError(f"RUN {run_dir}: not a kforge run directory (it has no {run.config.name})")
    raw = read_toml_file(run.config, "the run's settings")
    changes = read_changes(run.path)
    final = _settings(raw, changes, run, len(changes))
    trained = _trained_steps(run, final)
    planned = max(final.train.max_steps, trained)
    if not 1 <= step <= planned:
        raise InvalidInputError(
            f"--step {step}: {run.path} has steps 1 to {planned} (train.max_steps = {final.train.max_steps})"
        )
    positions = read_data_positions(run.path) or [_legacy_start(run, changes)]
    earlier = [p for p in positions if p.step < step]
    if not earlier:
        raise InvalidInputError(f"{run.data_positions}: no record of where the data of step {step} began")
    pos = earlier[-1]
    settings = _settings(raw, changes, run, pos.config_changes)
    if settings.vlm is not None:
        raise InvalidInputError(f"{run.path} trains a vision-language model: data-trace reads text runs only")
    sources = training_sources(settings.data)
    seq_len = int_of(pos.data.get("seq_len", settings.train.seq_len))
    windows = [Windows(s.train, seq_len) for s in sources]
    names = [s.name for s in sources]
    _check_data(names, [w.num_windows for w in windows], sources, pos.data)
    data = pos.data
    dp = int_of(data.get("dp_size", 1))
    batch = int_of(data.get("batch_size", settings.train.batch_size))
    accum = int_of(data.get("grad_accum_steps", settings.train.grad_accum_steps))
    if rank is not None and not 0 <= rank < dp:
        raise InvalidInputError(f"--rank {rank}: step {step} ran on {dp} data-parallel rank(s), 0 to {dp - 1}")
    weights = [d.weight for d in settings.data.datasets] if settings.data.datasets else [1.0]
    schedule = MixtureSchedule.build(names, weights, settings.data.temperature, settings.data.phases)
    seed = int_of(data.get("data_seed", settings.data_seed))
    order = SampleOrder(
        names,
        [w.num_windows for w in windows],
        schedule,
        seed=seed,
        batch_size=batch,
        dp_rank=0,
        dp_size=dp,
        grad_accum_steps=accum,
    )
    counts = list_of(data.get("counts", [0] * len(names)), "counts")
    start = Cursor(int_of(data.get("batch", 0)), int_of(data.get("sample", 0)), tuple(int_of(c) for c in counts))
    cursor = order.advance(start, (step - 1 - pos.step) * accum)
    trace = StepTrace(
        run_dir=str(run.path),
        step=step,
        trained=step <= trained,
        seq_len=seq_len,
        batch_size=batch,
        dp_size=dp,
        grad_accum_steps=accum,
        world_size=pos.world_size,
        rank=rank,
        data_step=order.step_of(cursor),
        global_sample=cursor.sample,
        since={"step": pos.step, "reason": pos.reason, "line": pos.line},
        datasets={s.name: s.origin for s in sources},
        rewinds=[
            dict(p.skip) for p in positions if p.skip is not None and p.step < step <= int_of(p.skip["detected_at"])
        ],
    )
    tokenizer = _tokenizer(run) if decode else None
    eos = [int_of(s.tokenizer.get("eos_id", -1)) for s in sources]
    ranks = range(dp) if rank is None else [rank]
    for micro in range(accum):
        plan = order.group_batch(cursor)
        for r in ranks:
            for row in range(batch):
                d, w = int(plan.dataset_ids[r * batch + row]), int(plan.windows[r * batch + row])
                lo, hi = windows[d].span(w)
                stream = sources[d].train
                if isinstance(stream, ShardedTokens):
                    pieces = [Piece(str(stream.shards[i].path), o, n) for i, o, n in stream.pieces(lo, hi)]
                else:
                    pieces = [Piece("", lo, hi - lo)]
                tokens = np.asarray(stream.read(lo, hi))
                ends = np.flatnonzero(tokens == eos[d]).tolist()
                text = tokenizer.decode(tokens.tolist()) if tokenizer is not None else None
                trace.samples.append(SampleTrace(micro, r, row, names[d], w, lo, hi - lo, pieces, ends, text))
        cursor = plan.after
    return trace


def _tokenizer(run: RunDir):
    from kforge_cli.engine.data.run_tokenizer import run_tokenizer

    return run_tokenizer(run.path, what=f"the run {run.path}")
