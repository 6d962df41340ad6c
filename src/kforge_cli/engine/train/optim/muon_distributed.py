"""Muon's Newton-Schulz for sharded (DTensor) matrices, split over the ranks that hold them.

Why: Muon orthogonalises each *whole* matrix. Gathering every matrix on every rank
(``full_tensor()``) and running Newton-Schulz for all of them everywhere costs every rank
the FLOPs of the whole model's matrices whatever the number of ranks: 64x redundant work
at 64 ranks. Here each matrix gets one *owner* among the ranks of its mesh, and only the
owner orthogonalises it, so a rank does ~1/N of the work.

Owners: greedy largest-first (LPT) on the Newton-Schulz cost of each matrix
(``newton_schulz_flops``): the costliest matrix not yet placed goes to the least loaded
rank. That is within 4/3 of the best split, and within a few percent with the hundreds of
matrices of a real model.

Redistribution (chosen over "all-gather everything, compute your share, broadcast the
results", which moves every matrix to every rank as today does): per round, two
``all_to_all_single`` over the flattened mesh of the parameters (FSDP, HSDP or FSDP x TP,
the ranks of one pipeline stage), each rank with uneven splits:

1. gather: every rank sends the block it holds of each matrix to that matrix's owner (a
   block held by several ranks, replicated over a mesh dim, is sent once: by the owner when
   it holds it, else by one holder picked by the owner's rank);
2. the owner assembles the full momentum update and runs the same ``zeropower_via_newtonschulz``
   in the same dtype as the single-process path, so the result is bitwise the one every rank
   computed before;
3. scatter: the owner sends every rank the block of the result that rank holds.

A rank receives about its share of the matrices (1/N of them) and sends about the same, in
each direction, instead of receiving (N-1)/N of every matrix in one all-gather per matrix.

Which block of a matrix a rank holds comes from DTensor's ``compute_local_shape_and_global_offset``
(what DCP uses to place checkpoint shards), all-gathered once per set of parameters and
checked to tile the matrix exactly; a layout whose shards are not blocks (a strided shard
that is not contiguous) keeps the gather-everywhere path for that matrix.

Memory: a round gives an owner at most ``round_bytes`` of full matrices (at least one matrix,
so ``B = max(round_bytes, largest matrix)``). Blocks go straight into the send buffers and a
full matrix is freed as soon as its result is in the scatter buffer, so a rank's temporaries
peak at about 2 x B (received blocks and full matrices; then full matrices and results) plus
Newton-Schulz's own on one matrix, about what gathering one matrix at a time costs
(``full_tensor()``, Newton-Schulz, ``distribute_tensor``) when the largest matrix exceeds 64 MiB.
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[int, int, int, int]  # first row, first column, rows, columns of the block in the global matrix
ROUND_BYTES = 64 * 2**20  # full matrices an owner holds at once (at least one matrix)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``zeropower_via_newtonschulz`` on a rows x cols matrix: per step, with m <= n the
    smaller side, ``X X^T`` (2 m^2 n), ``A @ A`` (2 m^3) and ``B @ X`` (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: Sequence[int], n_ranks: int) -> list[int]:
    """The owner rank of each item: largest cost first, each to the least loaded rank (ties: lowest rank)."""
    heap = [(0, r) for r in range(n_ranks)]
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owner


def mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over every rank of ``mesh`` (a DeviceMesh), flattening a multi-dim mesh.

    ``_flatten`` creates the groups of every slice of the root mesh (a collective over all
    ranks), so every rank must reach here for the same dim names in the same order.
    """
    if mesh.ndim == 1:
        return mesh.get_group()
    name = "_".join(["muon", *(mesh.mesh_dim_names or ()), "x".join(str(n) for n in mesh.shape)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mesh._flatten(name).get_group()


@dataclass(frozen=True)
class Matrix:
    """One Muon matrix of this step: its parameter and how to make this rank's block of its update."""

    param: DTensor
    steps: int  # Newton-Schulz iterations
    local_update: Callable[[], torch.Tensor]  # this rank's block of the momentum update (called at most once)


def _volume(box: Box) -> int:
    return box[2] * box[3]


def _local_box(p: DTensor) -> Box:
    """The block of the global matrix this rank holds; (-1, ...) when the local tensor is not that block."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(p.to_local().shape) != tuple(shape) or len(shape) != 2:
        return (-1, -1, -1, -1)
    return (int(offset[0]), int(offset[1]), int(shape[0]), int(shape[1]))


def _tiles(boxes: list[Box], rows: int, cols: int) -> bool:
    """True when the distinct non-empty blocks lie inside the matrix and their areas add up to it.

    Shards of Shard/_StridedShard/Replicate placements are identical or disjoint, so with the
    areas adding up they tile the matrix; anything else fails the sum or the bounds."""
    distinct = {b for b in boxes if _volume(b) > 0}
    if any(b[0] < 0 or b[1] < 0 or b[0] + b[2] > rows or b[1] + b[3] > cols for b in distinct):
        return False
    return sum(_volume(b) for b in distinct) == rows * cols


@dataclass
class SplitPlan:
    """Who orthogonalises which matrix, and what moves where; computed once per set of parameters."""

    group: dist.ProcessGroup
    rank: int  # this rank in ``group``
    size: int
    boxes: list[list[Box]]  # [matrix][rank]: the block each rank holds
    owner: list[int]  # [matrix]: the rank that orthogonalises it
    source: list[dict[Box, int]]  # [matrix]: for each distinct block, the rank that sends it to the owner
    rounds: list[list[int]]  # matrices per round, ascending
    fallback: list[int]  # matrices whose shards are not blocks: gathered on every rank as before
    flops: list[int]  # [rank]: Newton-Schulz FLOPs per step


def build_plan(group: dist.ProcessGroup, matrices: Sequence[Matrix], round_bytes: int = ROUND_BYTES) -> SplitPlan:
    """All-gather each rank's blocks over ``group`` and assign owners and rounds (a collective)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    device = matrices[0].param.to_local().device
    mine = torch.tensor([_local_box(m.param) for m in matrices], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    table: list[list[list[int]]] = torch.stack(gathered).tolist()
    boxes: list[list[Box]] = [[tuple(table[r][i]) for r in range(size)] for i in range(len(matrices))]  # type: ignore[misc]
    shapes = [(int(m.param.shape[0]), int(m.param.shape[1])) for m in matrices]
    split = [i for i in range(len(matrices)) if _tiles(boxes[i], *shapes[i])]
    fallback = sorted(set(range(len(matrices))) - set(split))
    costs = {i: newton_schulz_flops(*shapes[i], matrices[i].steps) for i in split}
    owners = assign_owners([costs[i] for i in split], size)
    owner = [-1] * len(matrices)
    for i, r in zip(split, owners, strict=True):
        owner[i] = r
    source: list[dict[Box, int]] = [{} for _ in matrices]
    for i in split:
        holders: dict[Box, list[int]] = {}
        for r, b in enumerate(boxes[i]):
            if _volume(b) > 0:
                holders.setdefault(b, []).append(r)
        d = owner[i]
        source[i] = {b: d if d in hs else hs[d % len(hs)] for b, hs in holders.items()}
    flops = [0] * size
    for i in split:
        flops[owner[i]] += costs[i]
    for i in fallback:  # every rank runs it
        flops = [f + newton_schulz_flops(*shapes[i], matrices[i].steps) for f in flops]
    nbytes = {i: shapes[i][0] * shapes[i][1] * matrices[i].param.element_size() for i in split}
    budget = max([round_bytes, *nbytes.values()])
    chunks: dict[int, list[list[int]]] = {}
    for i in sorted(split, key=lambda i: (-costs[i], i)):
        own = chunks.setdefault(owner[i], [[]])
        if own[-1] and sum(nbytes[j] for j in own[-1]) + nbytes[i] > budget:
            own.append([])
        own[-1].append(i)
    n_rounds = max((len(c) for c in chunks.values()), default=0)
    rounds = [sorted(i for c in chunks.values() if k < len(c) for i in c[k]) for k in range(n_rounds)]
    return SplitPlan(group, rank, size, boxes, owner, source, rounds, fallback, flops)


def _starts(sizes: list[int]) -> list[int]:
    """Where each rank's segment begins in a buffer laid out rank after rank."""
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def _exchange(plan: SplitPlan, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    """One ``all_to_all_single``: segment r of ``send`` goes to rank r; returns what arrived, by source rank."""
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=plan.group)
    return recv


def orthogonalise_split(
    plan: SplitPlan,
    matrices: Sequence[Matrix],
    orthogonalise: Callable[[torch.Tensor, int], torch.Tensor],
    apply: Callable[[int, torch.Tensor], None],
) -> None:
    """Run every round of ``plan``: ``apply(i, block)`` gets this rank's block of matrix i's result.

    ``orthogonalise(full, steps)`` is the single-process function (Newton-Schulz and scale);
    it runs only on the owner of each matrix. Blocks are written straight into the send
    buffers, and each full matrix is freed once its result is in the scatter buffer.
    """
    me, size = plan.rank, plan.size
    for members in plan.rounds:
        like = matrices[members[0]].param.to_local()
        # 1. gather: my block of each matrix to its owner, if I am the one who sends that block
        outgoing: list[list[int]] = [[] for _ in range(size)]  # by owner, in matrix order
        for i in members:
            box = plan.boxes[i][me]
            if _volume(box) > 0 and plan.source[i].get(box) == me:
                outgoing[plan.owner[i]].append(i)
        send_sizes = [sum(_volume(plan.boxes[i][me]) for i in out) for out in outgoing]
        send = like.new_empty(sum(send_sizes))
        offset = 0
        for out in outgoing:
            for i in out:
                _, _, nr, nc = plan.boxes[i][me]
                send[offset : offset + nr * nc].view(nr, nc).copy_(matrices[i].local_update())
                offset += nr * nc
        mine = [i for i in members if plan.owner[i] == me]
        incoming: list[list[tuple[int, Box]]] = [[] for _ in range(size)]  # by source: (matrix, block)
        for i in mine:  # ascending: a source sends its blocks in matrix order
            for box, src in plan.source[i].items():
                incoming[src].append((i, box))
        recv = _exchange(plan, send, send_sizes, [sum(_volume(b) for _, b in pieces) for pieces in incoming])
        del send
        full = {i: like.new_empty(tuple(matrices[i].param.shape)) for i in mine}
        offset = 0
        for pieces in incoming:
            for i, (r0, c0, nr, nc) in pieces:
                full[i][r0 : r0 + nr, c0 : c0 + nc].copy_(recv[offset : offset + nr * nc].view(nr, nc))
                offset += nr * nc
        del recv
        # 2. orthogonalise my matrices; 3. scatter: every rank's block of each result
        send_sizes = [sum(_volume(plan.boxes[i][r]) for i in mine) for r in range(size)]
        send = like.new_empty(sum(send_sizes))
        cursor = _starts(send_sizes)
        for i in mine:
            result = orthogonalise(full.pop(i), matrices[i].steps)
            for r in range(size):
                r0, c0, nr, nc = plan.boxes[i][r]
                if nr * nc > 0:
                    send[cursor[r] : cursor[r] + nr * nc].view(nr, nc).copy_(result[r0 : r0 + nr, c0 : c0 + nc])
                    cursor[r] += nr * nc
            del result
        mine_blocks = [(i, plan.boxes[i][me]) for i in members if _volume(plan.boxes[i][me]) > 0]
        recv_sizes = [0] * size
        for i, box in mine_blocks:
            recv_sizes[plan.owner[i]] += _volume(box)
        recv = _exchange(plan, send, send_sizes, recv_sizes)
        del send
        cursor = _starts(recv_sizes)
        for i, (_, _, nr, nc) in mine_blocks:  # from each owner, in matrix order
            src = plan.owner[i]
            apply(i, recv[cursor[src] : cursor[src] + nr * nc].view(nr, nc))
            cursor[src] += nr * nc
