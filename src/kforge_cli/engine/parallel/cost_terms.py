"""The shape of a parallelism's communication cost term (pure: no torch at call time).

Each parallelism's module (``fsdp``, ``tensor_parallel``, ``context_parallel``,
``expert_parallel``, ``pipeline``) exports ``comm_terms(...)``: the :class:`Traffic` one rank
moves per optimizer step, and the buffers it holds (``*_buffer_bytes``). The planner
(``engine.plan.cost_model``) turns a term into seconds over the link its group spans and sums
them; it knows no parallelism's formula. Teaching the planner a parallelism is a new
``comm_terms`` beside its code, a ``plan.<kind>_overlap`` setting and one call in
``cost_model.comm_traffic`` (docs/distributed.md, "Teaching the planner a parallelism").
"""

from __future__ import annotations

from typing import NamedTuple

FP32 = 4


class Traffic(NamedTuple):
    """Bytes one rank sends per optimizer step in collectives of one kind over a group of
    ``size`` ranks whose neighbours are ``stride`` ranks apart (the link: inside a node when
    ``size x stride`` fits in it)."""

    kind: str  # fsdp, tp, cp, ep, pp: also the name of its plan.<kind>_overlap
    bytes: float
    size: int
    stride: int


def ring_share(size: int) -> float:
    """The share of a gathered (or reduce-scattered) buffer that passes through each of ``size`` ranks."""
    return (size - 1) / size if size > 1 else 0.0
