"""lm-evaluation-harness on a kforge checkpoint, no export step (optional extra ``kforge[lm-eval]``).

:class:`KforgeLM` implements the harness's ``LM`` interface with the checkpoint's model
and tokenizer: log-likelihoods through :func:`continuation_logliks`, generation through
the KV-cache decoder. Requests are tokenized the way the harness's own ``hf`` backend
does (trailing context spaces move to the continuation, the pair is encoded whole and
split; an empty context is the EOS token, the document separator kforge trains with), so
a checkpoint and its ``export-hf`` directory score the same tokens.

A task is a harness task name, or the path of a task YAML (``lm-eval:tasks/my_mc.yaml``):
its relative ``data_files`` are read from the YAML's directory. The task's data must
already be on disk; kforge never downloads. A task YAML is someone's file: it is read
bounded (size, aliases, includes) and the Python its ``!function`` tags name is imported
only when ``--allow-hooks`` lists its modules (the harness's built-in tasks need none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer
from kforge_cli.engine.interop.open_checkpoint import LoadedCheckpoint
from kforge_cli.engine.model.generation import Sampling
from kforge_cli.engine.model.scoring import continuation_logliks
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.task_code import (  # the consent for task code is torch-free: it lives with the settings
    refuse_unallowed_task_code,
)


def _lm_base() -> type:
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise InvalidInputError("lm-eval tasks need lm-evaluation-harness: pip install 'kforge[lm-eval]'") from None
    return LM


def encode_pair(
    tok: ByteTokenizer | HFTokenizer, eos_id: int, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness's ``hf`` backend splits them."""
    if not context:
        return [eos_id], tok.encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx) :]


def make_adapter(loaded: LoadedCheckpoint) -> object:
    """A harness ``LM`` over `loaded` (the class is built here so the module imports without lm_eval)."""
    base = _lm_base()
    tok = loaded.tokenizer

    class KforgeLM(base):  # type: ignore[misc, valid-type]
        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            out = []
            for req in requests:
                context, continuation = req.args
                ctx, cont = encode_pair(tok, tok.eos_id, context, continuation)
                (ll,) = continuation_logliks(loaded.model, ctx, [cont])
                out.append((ll, _is_greedy(loaded, ctx, cont)))
            return out

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            return [continuation_logliks(loaded.model, [tok.eos_id], [tok.encode(r.args[0])])[0] for r in requests]

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            from kforge_cli.engine.inference.sampling import generate_text

            out = []
            for req in requests:
                context, kwargs = req.args
                until = kwargs.get("until") or []
                (done,) = generate_text(
                    loaded,
                    [context],
                    sampling=Sampling(temperature=0.0),
                    max_new_tokens=int(kwargs.get("max_gen_toks", 256)),
                    stop=[until] if isinstance(until, str) else list(until),
                )
                out.append(done.completion)
            return out

    return KforgeLM()


def _is_greedy(loaded: LoadedCheckpoint, context: list[int], continuation: list[int]) -> bool:
    import torch

    limit = int(loaded.cfg.max_seq_len)
    with torch.no_grad():
        seq = torch.tensor([(context + continuation)[-(limit + 1) :][:-1]])
        picks = loaded.model(seq)[0, -len(continuation) :].argmax(-1).tolist()
    return picks == continuation


def _resolve_files(files: object, base: Path) -> object:
    if isinstance(files, str):
        return str(base / files) if not Path(files).is_absolute() else files
    if isinstance(files, list):
        return [_resolve_files(f, base) for f in files]
    if isinstance(files, dict):
        return {k: _resolve_files(v, base) for k, v in files.items()}
    return files


def task_config(path: str | Path, allowed: list[str] | None = None) -> dict[str, object]:
    """A harness task YAML as the config dict ``simple_evaluate`` takes, relative data files made absolute.

    The file and its includes are bounded and their ``!function`` code refused unless
    allowed (:func:`refuse_unallowed_task_code`) before the harness's own loader reads it
    (``include``, ``!function``), so a YAML kforge accepts is one ``lm_eval --include_path``
    would run the same way.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidInputError(f"lm-eval task file {path} does not exist")
    refuse_unallowed_task_code(path, allowed)
    _lm_base()
    try:
        from lm_eval.tasks._yaml_loader import load_yaml

        config = load_yaml(path)
    except ImportError:  # another 0.4.x layout
        import yaml

        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception as exc:
        raise InvalidInputError(f"lm-eval task file {path} is not a readable task YAML ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise InvalidInputError(f"lm-eval task file {path} has no `task:` name")
    base = path.resolve().parent
    given = config.get("dataset_kwargs")
    kwargs = dict(given) if isinstance(given, dict) else {}
    if "data_files" in kwargs:
        kwargs["data_files"] = _resolve_files(kwargs["data_files"], base)
        config["dataset_kwargs"] = kwargs
    local = config.get("dataset_path")
    if isinstance(local, str) and (base / local).exists():
        config["dataset_path"] = str(base / local)
    return config


def task_spec(task: str, allowed: list[str] | None = None) -> tuple[str | dict[str, object], str]:
    """(what ``simple_evaluate`` takes, the task's name) for a task name or a task YAML path."""
    if task.endswith((".yaml", ".yml")):
        config = task_config(task, allowed)
        return config, str(config["task"])
    return task, task


def task_manager(spec: str | dict[str, object]) -> object:
    """The harness's task index: none of its built-in tasks for a task YAML (indexing them takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False) if isinstance(spec, dict) else None


def run_lm_eval(
    loaded: LoadedCheckpoint, task: str, *, limit: int | None = None, allowed: list[str] | None = None
) -> dict[str, float]:
    """Run one harness task on the checkpoint; its numeric metrics (``acc,none`` -> ``acc``) and example count.

    `allowed`: the ``--allow-hooks`` modules a task YAML's ``!function`` tags may import.
    """
    adapter = make_adapter(loaded)
    spec, name = task_spec(task, allowed)
    import lm_eval

    simple_evaluate: Any = lm_eval.simple_evaluate  # its decorator hides the signature from type checkers
    try:
        result = simple_evaluate(
            model=adapter,
            tasks=[spec],
            task_manager=task_manager(spec),
            limit=limit,
            bootstrap_iters=0,
            log_samples=False,
        )
    except Exception as exc:  # a missing task or task data the harness would have to download
        raise InvalidInputError(
            f"lm-eval task {task!r} did not run ({exc}); its data must be available locally"
        ) from exc
    result = result or {}
    metrics = result.get("results", {}).get(name, {})
    out = {k.split(",")[0]: float(v) for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k}
    count = (result.get("n-samples") or {}).get(name, {}).get("effective")
    if isinstance(count, int | float):
        out["examples"] = float(count)
    return out
