"""`kforge eval`: held-out loss and multiple-choice accuracy of one checkpoint, on one process.

Task specs: ``heldout`` (the run's own validation data: every window of the split, or
with ``max_batches`` the first batches training evaluated on with one data-parallel
rank), ``heldout:DIR`` (a prepared directory's val split),
``PATH.jsonl`` (a multiple-choice task, named after the file), ``lm-eval:NAME`` or
``lm-eval:TASK.yaml`` (an lm-evaluation-harness task, registered or a local YAML, through
:mod:`lm_eval_adapter`; the optional extra).
Results go to the terminal, to ``RUN_DIR/eval/step_N.json`` and to the run's trackers as
``eval/<task>/<metric>`` at the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import torch

from kforge_cli.common.files import atomic_write, real_dir
from kforge_cli.engine.data.bundle import build_data
from kforge_cli.engine.evaluation.mc_tasks import read_mc_task
from kforge_cli.engine.interop.open_checkpoint import LoadedCheckpoint, check_tokenizer_fits
from kforge_cli.engine.model.scoring import continuation_logliks
from kforge_cli.engine.train.loss import IGNORE_INDEX, build_loss_fn
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.saved_config import saved_settings
from kforge_cli.settings import JobSettings

Results = dict[str, dict[str, float]]
CONTEXT_CHARS_PER_TOKEN = 64  # characters of a multiple-choice context kept per position the model can see
log = logging.getLogger("kforge")


def run_settings(loaded: LoadedCheckpoint) -> JobSettings:
    """The settings the run was trained with (its config.toml), needed for held-out data."""
    if loaded.run_dir is None or not RunDir(loaded.run_dir).has_config():
        raise InvalidInputError(
            f"{loaded.path} is not inside a run directory with config.toml: the heldout task needs the run's data"
        )
    return saved_settings(loaded.run_dir)


def heldout_loss(
    loaded: LoadedCheckpoint, data_dir: str | None = None, max_batches: int | None = None
) -> dict[str, float]:
    """Mean loss per valid token over the validation split, and perplexity, tokens and batches scored.

    By default every window of the split once (:meth:`ValData.iter_split`). With
    `max_batches` the first that many batches training's evaluation uses (``eval.steps`` =
    `max_batches` gives the ``eval_loss`` training logged, on one data-parallel rank). The
    loss function is training's (z-loss included); the mean is token-weighted over all batches.
    """
    settings = run_settings(loaded)
    if data_dir is not None:
        _check_heldout_tokenizer(settings, data_dir)
        settings.eval.path = data_dir
    bundle = build_data(settings, dp_rank=0, dp_size=1)
    val = bundle.val
    if val is None:
        raise InvalidInputError("the run has no validation data; give one: --task heldout:PREPARED_DIR")
    loss_fn = build_loss_fn(settings)
    batch_size = settings.eval.batch_size or settings.train.batch_size
    device = next(loaded.model.parameters()).device
    batches = val.iter_split(batch_size) if max_batches is None else val.iter_batches(max_batches, batch_size)
    total, tokens, count = torch.zeros((), dtype=torch.float64), 0, 0
    with torch.no_grad():
        for batch in batches:
            kwargs = {k: batch[k].to(device) for k in ("doc_ids", "positions") if k in batch}
            logits = loaded.model(batch["input_ids"].to(device), **kwargs)
            labels = batch["labels"].to(device)
            total += loss_fn.from_logits(logits.float(), labels).double().cpu()
            tokens += int((labels != IGNORE_INDEX).sum())
            count += 1
    loss = float(total / max(tokens, 1))
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": float(tokens), "batches": float(count)}


def _tokenizer_name(tokenizer: Mapping[str, object]) -> str:
    if tokenizer.get("kind") == "byte":
        return "the byte tokenizer"
    sha = str(tokenizer.get("sha256", ""))[:12]
    return f"a tokenizer.json (vocab {tokenizer.get('vocab_size', '?')}, sha256 {sha}...)"


def _check_heldout_tokenizer(settings: JobSettings, data_dir: str) -> None:
    """``--task heldout:DIR`` on data of another tokenizer than the run's: say which two clash (exit 2)."""
    from kforge_cli.engine.data.shards import load_prepared
    from kforge_cli.engine.data.tokenizer import ByteTokenizer

    mine = ByteTokenizer().describe()
    train_path = settings.data.path or (settings.data.datasets[0].path if settings.data.datasets else None)
    if train_path:
        mine = load_prepared(train_path).tokenizer
    theirs = load_prepared(data_dir).tokenizer
    if theirs != mine:
        raise InvalidInputError(
            f"--task heldout:{data_dir}: that directory was prepared with {_tokenizer_name(theirs)}, but the run "
            f"was trained on {train_path or 'the built-in corpus'} with {_tokenizer_name(mine)}: prepare it again "
            f"with `kforge prepare-data ... --tokenizer "
            f"{'byte' if mine.get('kind') == 'byte' else (Path(train_path or '.') / 'tokenizer.json')}`"
        )


def multiple_choice(loaded: LoadedCheckpoint, path: str | Path, limit: int | None = None) -> dict[str, float]:
    """``acc`` (highest log-likelihood) and ``acc_norm`` (log-likelihood per character of the choice)."""
    check_tokenizer_fits(loaded)
    tok = loaded.tokenizer
    examples = read_mc_task(path)[:limit]
    max_len = int(loaded.cfg.max_seq_len)
    correct = correct_norm = 0
    for ex in examples:
        # only the last max_seq_len tokens of context can be seen: encode a bounded tail of the text
        # (a token covers far fewer than CONTEXT_CHARS_PER_TOKEN characters), never the whole of a huge one
        context = tok.encode(ex.context[-max_len * CONTEXT_CHARS_PER_TOKEN :]) or [tok.eos_id]
        choices = [tok.encode(c[: max_len * CONTEXT_CHARS_PER_TOKEN]) for c in ex.choices]
        for i, ids in enumerate(choices):
            if len(ids) >= max_len:
                raise InvalidInputError(
                    f"{ex.where}: choices[{i}] has at least {len(ids)} tokens, which does not fit the model's "
                    f"max_seq_len={max_len} with any context: shorten it"
                )
        context = context[-max_len:]
        logliks = continuation_logliks(loaded.model, context, choices)
        norm = [ll / len(c) for ll, c in zip(logliks, ex.choices, strict=True)]
        correct += int(max(range(len(logliks)), key=logliks.__getitem__) == ex.answer)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == ex.answer)
    n = len(examples)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "examples": float(n)}


def task_name(spec: str) -> str:
    if spec == "heldout" or spec.startswith("heldout:"):
        return "heldout" if spec == "heldout" else f"heldout_{Path(spec[8:]).name}"
    if spec.startswith("lm-eval:"):
        return Path(spec[8:]).stem if spec.endswith((".yaml", ".yml")) else spec[8:]
    return Path(spec).stem


def check_task(spec: str, allow_hooks: list[str] | None = None) -> None:
    """What can be checked of a task before a checkpoint is loaded: a task YAML's bounds and the
    consent for the Python it names (``--allow-hooks``); exit 2 otherwise. A task's name (it becomes a
    key in RUN_DIR/eval/step_N.json, a tracker metric and a table row) must be printable text."""
    from kforge_cli.settings.section import control_character, describe_character

    hit = control_character(spec)
    if hit is not None:
        raise InvalidInputError(
            f"--task {spec!r} holds a control character or other unprintable one, {describe_character(hit[0])}: "
            "rename the file"
        )
    if spec.startswith("lm-eval:") and spec.endswith((".yaml", ".yml")):
        from kforge_cli.settings.task_code import refuse_unallowed_task_code

        refuse_unallowed_task_code(spec[len("lm-eval:") :], allow_hooks)


def run_task(
    loaded: LoadedCheckpoint,
    spec: str,
    *,
    max_batches: int | None = None,
    limit: int | None = None,
    allow_hooks: list[str] | None = None,
) -> dict[str, float]:
    """One task spec (see the module docstring) -> its metrics (`allow_hooks`: see :func:`check_task`)."""
    if spec == "heldout":
        return heldout_loss(loaded, None, max_batches)
    if spec.startswith("heldout:"):
        return heldout_loss(loaded, spec[len("heldout:") :], max_batches)
    if spec.startswith("lm-eval:"):
        from kforge_cli.engine.evaluation.lm_eval_adapter import run_lm_eval

        return run_lm_eval(loaded, spec[len("lm-eval:") :], limit=limit, allowed=allow_hooks)
    if spec.endswith(".jsonl"):
        if not Path(spec).is_file():
            raise InvalidInputError(f"task file {spec} does not exist")
        return multiple_choice(loaded, spec, limit)
    raise InvalidInputError(
        f"unknown task {spec!r}: give heldout, heldout:PREPARED_DIR, a multiple-choice FILE.jsonl, lm-eval:NAME or lm-eval:TASK.yaml"
    )


def write_results(loaded: LoadedCheckpoint, results: Results) -> Path | None:
    """RUN_DIR/eval/step_N.json (merged with earlier tasks of that step); None outside a run dir."""
    if loaded.run_dir is None:
        return None
    try:
        out_dir = real_dir(RunDir(loaded.run_dir).eval_dir)  # a link is refused
    except PermissionError:  # someone else's read-only run: the table is the result
        log.warning("cannot write %s (no permission); results are printed only", RunDir(loaded.run_dir).eval_dir)
        return None
    path = out_dir / f"step_{loaded.step if loaded.step is not None else 'unknown'}.json"
    merged: dict[str, object] = {}
    if path.is_file() and not path.is_symlink():
        try:
            merged = json.loads(path.read_text()).get("tasks", {})
        except (OSError, json.JSONDecodeError, AttributeError):
            merged = {}
    merged.update(results)
    record = {"checkpoint": str(loaded.path), "step": loaded.step, "tasks": merged}
    atomic_write(path, (json.dumps(record, indent=2) + "\n").encode())  # never through a planted link
    return path


def log_to_trackers(loaded: LoadedCheckpoint, results: Results, *, to_file: bool = True) -> list[str]:
    """Append ``eval/<task>/<metric>`` at the checkpoint's step to metrics.jsonl and the run's backends
    (``to_file=False``: the backends only; a training that runs appends metrics.jsonl itself).

    Only on request (``kforge eval --track``): the trackers are the ones the run's config.toml
    names, which may be someone else's. Points are added to the training's own runs, which
    are never created, ended or re-marked here (W&B cannot take points from a second process
    without ending the run, so it is skipped).
    """
    if loaded.run_dir is None or loaded.step is None:
        return []
    from kforge_cli.engine.checkpoint.reader import metrics_run_ids, open_checkpoint
    from kforge_cli.engine.observe.metrics_file import MetricsFile
    from kforge_cli.engine.observe.mlflow_backend import MlflowBackend
    from kforge_cli.engine.observe.tensorboard_backend import TensorboardBackend
    from kforge_cli.engine.observe.tracker import Tracker, run_info, tracker_backends

    settings = run_settings(loaded)
    run_ids = metrics_run_ids(open_checkpoint(loaded.path).train_state)
    wanted = set(settings.metrics.backends) - {"jsonl"}
    if "wandb" in wanted:
        log.warning("wandb: kforge eval does not log to W&B (a second process would end the training's run)")
        settings.metrics.backends = [b for b in settings.metrics.backends if b != "wandb"]
        wanted.discard("wandb")
    backends = tracker_backends(settings.metrics, run_info(settings, loaded.run_dir, 1), run_ids) if wanted else []
    for backend in backends:
        if isinstance(backend, TensorboardBackend):
            backend.purge = False  # an old step: add points, never drop the training curve after it
        if isinstance(backend, MlflowBackend):
            backend.attach_only = True
    if not to_file and not backends:
        return []
    tracker = Tracker(MetricsFile(RunDir(loaded.run_dir).metrics) if to_file else None, backends)
    tracker.start()
    record: dict[str, object] = {"step": loaded.step}
    for task, metrics in results.items():
        record.update({f"eval/{task}/{name}": value for name, value in metrics.items()})
    try:
        tracker.write(record)
    finally:
        tracker.close("completed", end_runs=False)  # the run's status belongs to its training process
    return tracker.backend_names if to_file else tracker.backend_names[1:]
