"""The step function for pipeline parallelism, and the pipeline's forward-only loss (eval).

The loop hands the step its ``grad_accum_steps`` micro-batches; they are concatenated and
given to the schedule, which splits them back into the same micro-batches and runs
forward/backward per its plan (GPipe, 1F1B, interleaved, zero bubble). The loss of a
micro-batch is its *sum* over valid tokens times ``dp_size / (global valid tokens)``,
as in the plain step, so the gradients equal those of one process on the global batch.
The loss sums are known only on the last stage; they are summed over the ``pp`` group
(other stages add zero) and then over data-parallel ranks, so every rank reports the
same loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kforge_cli.engine.parallel.pipeline import stage_owner
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.loss import IGNORE_INDEX
from kforge_cli.engine.train.step import Batch, StepResult, clip_gradients, loss_sum_from_output, model_computes_loss

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def stage_kwargs(session: TrainingSession, batch: Batch) -> dict[str, Any]:
    """Keyword inputs every stage needs: RoPE positions (always explicit), document ids, and for a
    chunked loss the labels and loss function (the last stage then returns the loss sum itself)."""
    tokens = batch["input_ids"]
    positions = batch.get("positions")
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    out: dict[str, Any] = {"positions": positions}
    if "doc_ids" in batch:
        out["doc_ids"] = batch["doc_ids"]
    if model_computes_loss(session):
        out["labels"] = batch["labels"]
        out["loss_fn"] = session.loss_fn
    return out


def _reduce_loss(session: TrainingSession, local: torch.Tensor) -> torch.Tensor:
    """Sum a last-stage quantity over the pp group (so every stage has it), then over dp ranks."""
    all_reduce_sum(local, session.runtime.pp_group())
    return all_reduce_sum(local, session.runtime.dp_group())


def pipeline_step(session: TrainingSession, micro_batches: list[Batch]) -> StepResult:
    """One optimizer step's forward/backward through the pipeline schedule."""
    bundle = session.pipeline
    assert bundle is not None, "pipeline_step needs a model built with distributed.pp > 1"
    runtime = session.runtime
    device = runtime.device
    local_valid = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    n_valid = all_reduce_sum(torch.tensor(float(local_valid), device=device), runtime.dp_group())
    scale = runtime.dp_size / n_valid.clamp(min=1.0)
    batch = {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}

    def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_sum_from_output(session, output, target) * scale

    # The schedule may also call the loss once to infer shapes at its first step, so the
    # reported loss comes from `losses` (one entry per real micro-batch), not from loss_of.
    losses: list[torch.Tensor] = []
    bundle.loss.fn = loss_of
    try:
        args = (batch["input_ids"],) if bundle.is_first else ()
        target = batch["labels"] if bundle.is_last else None
        bundle.schedule.step(*args, target=target, losses=losses, return_outputs=False, **stage_kwargs(session, batch))
    finally:
        bundle.loss.fn = None
    local = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros((), device=device)
    # sum over micro-batches, stages and dp ranks of (loss sum * dp_size / n_valid) = dp_size * mean loss
    total = _reduce_loss(session, local.to(device=device, dtype=torch.float32)) / runtime.dp_size
    grad_norm = clip_gradients(session)
    n = float(n_valid)
    return StepResult(loss=float(total), grad_norm=grad_norm, valid_tokens=int(n))


def _send(tensor: torch.Tensor, peer: int, group: Any) -> None:
    header = torch.zeros(8, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header, group=group, group_dst=peer)
    dist.send(tensor.contiguous(), group=group, group_dst=peer)


def _recv(peer: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=peer)
    ndim = int(header[0])
    out = torch.empty([int(x) for x in header[2 : 2 + ndim]], dtype=_DTYPES[int(header[1])], device=device)
    dist.recv(out, group=group, group_src=peer)
    return out


@torch.no_grad()
def pipeline_forward_loss_sum(session: TrainingSession, batch: Batch) -> torch.Tensor:
    """The loss sum of ``batch`` through all stages, forward only, known on every pipeline rank.

    Used by evaluation: the batch runs through the stages in order with plain
    point-to-point sends, independent of the schedule's micro-batch count.
    """
    bundle = session.pipeline
    assert bundle is not None
    runtime = session.runtime
    group, me = runtime.pp_group(), runtime.pp_rank
    kwargs = stage_kwargs(session, batch)
    carried: torch.Tensor | None = None
    local = torch.zeros((), device=runtime.device, dtype=torch.float32)
    for sid in range(bundle.num_stages):
        owner = stage_owner(sid, runtime.pp_size, bundle.schedule_name)
        prev = stage_owner(sid - 1, runtime.pp_size, bundle.schedule_name) if sid else owner
        if owner != me:
            if prev == me and carried is not None:
                _send(carried, owner, group)
                carried = None
            continue
        x = batch["input_ids"] if sid == 0 else (carried if prev == me else _recv(prev, group, runtime.device))
        out = bundle.modules[bundle.stage_ids.index(sid)](x, **kwargs)
        if sid == bundle.num_stages - 1:
            local = local + loss_sum_from_output(session, out, batch["labels"]).float()
        carried = out
    all_reduce_sum(local, group)
    return local
