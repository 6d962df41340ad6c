"""lm-evaluation-harness on a kforge checkpoint, no export step (optional extra ``kforge[lm-eval]``).

:class:`KforgeLM` implements the harness's ``LM`` interface with the checkpoint's model
and tokenizer: log-likelihoods through :func:`continuation_logliks`, generation through
the KV-cache decoder. The task's data must already be on disk (the harness's cache or
a local dataset); kforge never downloads.
"""

from __future__ import annotations

from typing import Any

from kforge_cli.engine.inference.source import LoadedCheckpoint
from kforge_cli.engine.model.generation import Sampling
from kforge_cli.engine.model.scoring import continuation_logliks
from kforge_cli.errors import InvalidInputError


def _lm_base() -> type:
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise InvalidInputError("lm-eval tasks need lm-evaluation-harness: pip install 'kforge[lm-eval]'") from None
    return LM


def make_adapter(loaded: LoadedCheckpoint) -> Any:
    """A harness ``LM`` over `loaded` (the class is built here so the module imports without lm_eval)."""
    base = _lm_base()
    tok = loaded.tokenizer

    class KforgeLM(base):  # type: ignore[misc, valid-type]
        def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
            out = []
            for req in requests:
                context, continuation = req.args
                ctx, cont = tok.encode(context) or [tok.eos_id], tok.encode(continuation)
                (ll,) = continuation_logliks(loaded.model, ctx, [cont])
                greedy = _is_greedy(loaded, ctx, cont)
                out.append((ll, greedy))
            return out

        def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
            return [continuation_logliks(loaded.model, [tok.eos_id], [tok.encode(r.args[0])])[0] for r in requests]

        def generate_until(self, requests: list[Any]) -> list[str]:
            from kforge_cli.engine.inference.generate import generate_text

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

    with torch.no_grad():
        seq = torch.tensor([(context + continuation)[:-1]])
        picks = loaded.model(seq)[0, -len(continuation) :].argmax(-1).tolist()
    return picks == continuation


def run_lm_eval(loaded: LoadedCheckpoint, task: str, *, limit: int | None = None) -> dict[str, float]:
    """Run one harness task on the checkpoint; its numeric metrics (``acc,none`` -> ``acc``)."""
    adapter = make_adapter(loaded)
    from lm_eval import simple_evaluate

    try:
        result = simple_evaluate(model=adapter, tasks=[task], limit=limit)
    except Exception as exc:  # a missing task or task data the harness would have to download
        raise InvalidInputError(
            f"lm-eval task {task!r} did not run ({exc}); its data must be available locally"
        ) from exc
    metrics = (result or {}).get("results", {}).get(task, {})
    return {k.split(",")[0]: float(v) for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k}
