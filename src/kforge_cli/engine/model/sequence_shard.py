"""A sequence shard: which tokens of the full sequence this rank holds under context parallelism.

The sequence of ``T`` tokens is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunk
``r`` (a head chunk) and chunk ``2*cp - 1 - r`` (a tail chunk). Under causal attention a
query's work grows with its index, so pairing an early chunk with a late one gives every
rank the same amount of attention work (without it the last rank does ~(2*cp - 1) times
the first one's).

Attention over the full sequence gathers K/V from every rank of the group
(:func:`gather_sequence`, differentiable: the backward sums each rank's gradient of the
gathered K/V and hands every rank its own slice). The gathered keys stay in gathered order
(rank 0's chunks, then rank 1's, ...); the masks use :meth:`SequenceShard.key_index`, the
global index of each gathered key, so nothing is reordered.

With ``distributed.cp_attention = "ring"`` (CUDA, plain causal attention) attention instead
runs torch's context-parallel SDPA (:func:`ring_attention`): the same head + tail layout is
the one torch's ring kernels expect for load-balanced causal attention, so the shards need
no reordering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


def load_balanced_indices(seqlen: int, size: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (``[seqlen // size]``, ascending) of the tokens rank ``rank`` of ``size`` holds."""
    if seqlen % (2 * size):
        raise ValueError(f"sequence length {seqlen} is not divisible by 2 * cp = {2 * size}")
    chunk = seqlen // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * size - 1 - rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in a context-parallel group (set on the model by the parallel builder)."""

    group: ProcessGroup | None  # the process group of the CP ranks
    size: int
    rank: int
    ring_mesh: DeviceMesh | None = None  # the 1-D cp mesh when attention runs torch's ring SDPA (cp_attention = ring)

    def query_index(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return load_balanced_indices(local_len * self.size, self.size, self.rank, device)

    def key_index(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of the keys in gathered order (every rank's tokens, rank by rank)."""
        full = local_len * self.size
        return torch.cat([load_balanced_indices(full, self.size, r, device) for r in range(self.size)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; backward: sum the gradient over the group, keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Reduce-scatter along the gathered dim (moved to the front, where the collective splits):
        # rank r receives the sum over ranks of the gradient of its own slice (NCCL and gloo).
        grad = grads[0].movedim(ctx.dim, 0).contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim).contiguous(), None, None


def gather_sequence(x: torch.Tensor, shard: SequenceShard, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, differentiable."""
    out = _GatherSequence.apply(x, dim, shard.group)
    assert isinstance(out, torch.Tensor)
    return out


def gather_sequence_ids(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Integer tensors (document ids) ``[B, T_local]`` -> ``[B, T]`` in gathered order (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return torch.cat(parts, dim=1)


_ring_dispatcher_on = False


def enable_ring_attention() -> None:
    """Route DTensor SDPA calls to torch's ring kernels, once per process and for good: the
    backward of a ring SDPA runs after its forward returned, and must be routed the same way.
    Only :func:`ring_attention` makes SDPA calls on DTensors, so nothing else changes."""
    global _ring_dispatcher_on
    if _ring_dispatcher_on:
        return
    from torch.distributed.tensor.experimental._attention import _cp_options, _enable_context_parallel_dispatcher

    _cp_options.enable_load_balance = True  # the shards are head + tail chunks (load_balanced_indices)
    _enable_context_parallel_dispatcher()
    _ring_dispatcher_on = True


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence with torch's ring SDPA.

    ``q`` ``[B, H, T_local, hd]``, ``k``/``v`` ``[B, Hkv, T_local, hd]``: local tensors of this
    rank's head + tail chunks, wrapped as DTensors sharded on the sequence dim of the cp
    mesh; torch's kernels pass K/V around the group and merge the partial results by their
    log-sum-exp. K/V heads are repeated to the query heads first (the ring kernels are
    called per head group without SDPA's ``enable_gqa``).
    """
    from torch.distributed.tensor import DTensor, Shard

    if shard.ring_mesh is None:
        raise RuntimeError("ring attention needs the cp mesh (distributed.cp_attention = 'ring')")
    if q.shape[1] != k.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (DTensor.from_local(t.contiguous(), shard.ring_mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.to_local() if isinstance(out, DTensor) else out
