"""The schedule executor (pipeline parallelism), and the pipeline's forward-only loss (eval).

The loop hands the step its ``grad_accum_steps`` micro-batches; they are concatenated and
given to the schedule, which splits them back into the same micro-batches and runs
forward/backward per its plan (GPipe, 1F1B, interleaved, zero bubble). The loss of a
micro-batch is its *sum* over valid tokens times the step's `TokenNormaliser` scale
(``loss_ranks / global valid tokens``), as in the plain step, so the gradients equal those
of one process on the global batch. The loss sums are known only on the last stage; they
are summed over the ``pp`` group (other stages add zero) and then over data-parallel
ranks, so every rank reports the same loss. Evaluation runs the same schedule forward
only (``schedule.eval``) with scale 1.

Under context parallelism every micro-batch is first cut to this rank's sequence shard
(input ids, labels, positions and document ids together), so the schedule carries the
shard's positions and document ids to every stage as keyword inputs, and each stage's
attention gathers K/V over the CP group. The loss sums then span dp x cp
(`RuntimeContext.loss_group`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.parallel import PipelineBundle
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.step.core import (
    Batch,
    Executor,
    TokenNormaliser,
    context_shards,
    loss_sum_from_output,
    model_computes_loss,
)
from kforge_cli.engine.train.step.result import StepResult

if TYPE_CHECKING:
    from kforge_cli.engine.train.loss import LossFn
    from kforge_cli.engine.train.session import TrainingSession


def bind_pipeline_loss(session: TrainingSession) -> None:
    """Give the schedule's loss its rule once, when the session is assembled."""
    if session.pipeline is None:
        return
    session.pipeline.loss.bind(lambda output, target: loss_sum_from_output(session, output, target))


def _bundle(session: TrainingSession) -> PipelineBundle:
    if session.pipeline is None:
        raise RuntimeError("the schedule executor needs a model built with distributed.pp > 1")
    return session.pipeline


def stage_kwargs(session: TrainingSession, batch: Batch) -> dict[str, torch.Tensor | LossFn]:
    """Keyword inputs every stage needs: RoPE positions (always explicit), document ids, and for a
    chunked loss the labels and loss function (the last stage then returns the loss sum itself)."""
    tokens = batch["input_ids"]
    positions = batch.get("positions")
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    out: dict[str, torch.Tensor | LossFn] = {"positions": positions}
    if "doc_ids" in batch:
        out["doc_ids"] = batch["doc_ids"]
    if model_computes_loss(session):
        out["labels"] = batch["labels"]
        out["loss_fn"] = session.loss_fn
    return out


def _run_schedule(session: TrainingSession, batch: Batch, *, train: bool) -> torch.Tensor:
    """This rank's sum of the per-micro-batch losses the schedule returned (zero off the last stage)."""
    bundle = _bundle(session)
    args = (batch["input_ids"],) if bundle.is_first else ()
    target = batch["labels"] if bundle.is_last else None
    # The schedule may also call the loss once to infer shapes at its first step, so the
    # reported loss comes from `losses` (one entry per real micro-batch).
    losses: list[torch.Tensor] = []
    run = bundle.schedule.step if train else bundle.schedule.eval
    run(*args, target=target, losses=losses, return_outputs=False, **stage_kwargs(session, batch))
    device = session.runtime.device
    if not losses:
        return torch.zeros((), device=device, dtype=torch.float32)
    return torch.stack([x.detach().float() for x in losses]).sum().to(device)


def _reduce_over_stages_and_dp(session: TrainingSession, local: torch.Tensor) -> torch.Tensor:
    all_reduce_sum(local, session.runtime.pp_group())
    return all_reduce_sum(local, session.runtime.loss_group())  # dp (x cp) ranks: their tokens differ


class ScheduleStep(Executor):
    """One optimizer step's forward/backward through the pipeline schedule, with `features`
    composed in, then clipping."""

    def __call__(self, session: TrainingSession, micro_batches: list[Batch]) -> StepResult:
        bundle = _bundle(session)
        runtime = session.runtime
        micro_batches = context_shards(session, micro_batches)
        for feature in self.features:
            feature.before_step(session, micro_batches)
        norm = TokenNormaliser.for_step(session, micro_batches)
        batch = {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}
        if self.features:
            weights = norm.term_counts(session) * norm.scale
            for feature in self.features:
                feature.before_schedule(session, weights)
        bundle.loss.scale = norm.scale
        try:
            local = _run_schedule(session, batch, train=True)
        finally:
            bundle.loss.scale = 1.0
        # sum over micro-batches, stages and dp x cp ranks of (loss sum * scale) = loss_ranks * mean loss
        mean = _reduce_over_stages_and_dp(session, local) / runtime.loss_ranks
        return self.finish(session, mean, norm)


@torch.no_grad()
def pipeline_eval_loss_sum(session: TrainingSession, batch: Batch) -> torch.Tensor:
    """The loss sum of ``batch`` through all stages, forward only (the schedule's own ``eval``),
    known on every pipeline rank. ``batch`` holds ``grad_accum_steps`` micro-batches' rows."""
    local = _run_schedule(session, batch, train=False)
    return all_reduce_sum(local, session.runtime.pp_group())
