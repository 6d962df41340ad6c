"""Expert parallelism's token exchange: all-to-all to the experts' ranks and back.

Under ``distributed.ep = P`` each rank of an EP group holds ``L = E / P`` consecutive
experts (rank ``r``: experts ``r*L .. r*L + L - 1``, the ``Shard(0)`` of the stacked
weights). A rank routes its own tokens, sorts the copies by expert (as one process
does) and then:

1. exchanges the per-expert counts (``[E]`` -> ``[P, L]``: what each source sends to
   each of this rank's experts), the one host sync, since all-to-all needs its split sizes;
2. sends each destination its experts' rows (``all_to_all_single_autograd``: the
   backward is the reverse exchange, so gradients reach the senders' tokens);
3. reorders the received rows from (source, expert) to (expert, source), runs the local
   experts as one grouped GEMM, and undoes the reorder;
4. returns every row to its sender by the reverse all-to-all.

A row's result does not depend on which rows share its GEMM, so every token gets what
one process would compute for it (to float rounding of the GEMM's blocking).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Exchange:
    """One micro-batch's all-to-all layout: rows sent to / received from each EP rank, and the reorder."""

    send_splits: list[int]
    recv_splits: list[int]
    local_counts: torch.Tensor  # [L] rows per local expert, all sources together
    order: torch.Tensor  # received row index for each row of the expert-sorted local input


def plan_exchange(counts: torch.Tensor, group: dist.ProcessGroup) -> Exchange:
    """Exchange the per-expert ``counts`` ``[E]`` of this rank's sorted rows with the EP group."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    send = counts.to(torch.int64).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # equal splits: L counts per rank
    received = recv.view(ep, local)  # [source, local expert]
    splits = torch.stack([send.view(ep, local).sum(1), received.sum(1)]).tolist()  # the host sync
    expert_of_row = torch.arange(local, device=counts.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1), output_size=sum(splits[1]))
    order = torch.argsort(expert_of_row, stable=True)  # by local expert, then by source rank
    return Exchange(splits[0], splits[1], received.sum(0), order)


def run_experts_parallel(
    rows: torch.Tensor, counts: torch.Tensor, experts: ExpertFn, group: dist.ProcessGroup
) -> torch.Tensor:
    """``experts`` applied to ``rows`` (sorted by global expert, ``counts`` ``[E]``) on the experts' ranks."""
    ex = plan_exchange(counts, group)
    received = all_to_all_single_autograd(rows.contiguous(), ex.recv_splits, ex.send_splits, group)
    out = experts(received[ex.order], ex.local_counts)
    back = torch.empty_like(out).index_copy(0, ex.order, out)  # undo the reorder (differentiable)
    return all_to_all_single_autograd(back, ex.send_splits, ex.recv_splits, group)
