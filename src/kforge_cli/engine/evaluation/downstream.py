"""In-loop downstream evaluation: the multiple-choice tasks of ``eval.tasks``, every ``eval.interval``.

The same scoring as ``kforge eval`` (:func:`continuation_logliks`, ``acc`` and ``acc_norm``),
split over the data-parallel ranks: rank ``r`` scores the choices ``i`` with
``i % dp == r`` and one all-reduce gives every rank every log-likelihood. Under FSDP
every rank must run the same number of forwards, so the shorter shares are padded with a
repeat whose result is thrown away. Pipeline parallelism (no rank holds the whole model)
and context parallelism (no rank holds a whole sequence) are not supported; the tasks are
then skipped with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.evaluation.mc_tasks import MCExample, read_mc_task
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.errors import InvalidInputError

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")


def _loglik(session: TrainingSession, context: list[int], continuation: list[int]) -> float:
    model = session.model
    limit = int(session.settings.model.max_seq_len)
    seq = (context + continuation)[-(limit + 1) :]
    tokens = torch.tensor([seq[:-1]], device=session.runtime.device)
    with session.autocast():
        logits = model(tokens)
    full = getattr(logits, "full_tensor", None)  # a DTensor under TP with loss_parallel
    dense: torch.Tensor = full() if callable(full) else logits  # type: ignore[assignment]
    logprobs = dense[0].float().log_softmax(-1)
    targets = torch.tensor(seq[1:], device=logprobs.device)
    return float(logprobs.gather(1, targets[:, None])[-len(continuation) :, 0].double().sum())


def _score_task(session: TrainingSession, examples: list[MCExample]) -> dict[str, float]:
    tok = getattr(session.data, "tokenizer", None)
    if tok is None:
        raise InvalidInputError("eval.tasks need the training data's tokenizer; this data pipeline has none")
    pairs: list[tuple[list[int], list[int]]] = []
    for ex in examples:
        context = tok.encode(ex.context) or [tok.eos_id]
        pairs += [(context, tok.encode(c)) for c in ex.choices]
    rank, size = session.runtime.dp_rank, session.runtime.dp_size
    mine = list(range(rank, len(pairs), size))
    rounds = -(-len(pairs) // size)
    logliks = torch.zeros(len(pairs), dtype=torch.float64, device=session.runtime.device)
    for k in range(rounds):
        index = mine[k] if k < len(mine) else mine[0] if mine else 0  # padding: same work, result unused
        value = _loglik(session, *pairs[index])
        if k < len(mine):
            logliks[index] = value
    all_reduce_sum(logliks, session.runtime.dp_group())
    values = logliks.tolist()
    correct = correct_norm = 0
    start = 0
    for ex in examples:
        lls = values[start : start + len(ex.choices)]
        start += len(ex.choices)
        norm = [ll / len(c) for ll, c in zip(lls, ex.choices, strict=True)]
        correct += int(lls.index(max(lls)) == ex.answer)
        correct_norm += int(norm.index(max(norm)) == ex.answer)
    return {"acc": correct / len(examples), "acc_norm": correct_norm / len(examples)}


def downstream_eval(session: TrainingSession) -> dict[str, float]:
    """``{"eval/<task>/acc": ..., "eval/<task>/acc_norm": ...}`` for every task of ``eval.tasks``."""
    tasks = session.settings.eval.tasks
    if not tasks:
        return {}
    if session.pipeline is not None:
        log.warning("eval.tasks are not run under pipeline parallelism (no rank holds the whole model)")
        return {}
    if session.runtime.cp_size > 1:
        log.warning("eval.tasks are not run under context parallelism (each rank holds part of every sequence)")
        return {}
    out: dict[str, float] = {}
    was_training = session.model.training
    session.model.eval()
    try:
        with torch.no_grad():
            for path in tasks:
                metrics = _score_task(session, read_mc_task(path))
                out.update({f"eval/{Path(path).stem}/{k}": v for k, v in metrics.items()})
    finally:
        session.model.train(was_training)
    return out
