"""Context parallelism (``distributed.cp``): every sequence split over the ranks of the ``cp`` mesh dim.

Each CP rank holds a head chunk and a tail chunk of every sequence (load balanced for
causal attention, see :mod:`kforge_cli.engine.model.sequence_shard`). Everything
position-dependent is sharded together by :func:`shard_batch`: input ids, labels, RoPE
positions (made explicit, ``0..T-1``, when the batch has none) and document ids.
Attention gathers K/V from the whole group in every layer (exact for any mask, on gloo
and NCCL); everything else in a block is per token, so it runs on the local shard as is.

Memory: activations scale with the local tokens, ``T / cp``, except the gathered K/V that
attention keeps for its backward (``2 x T x kv_dim`` per layer). Communication: per layer,
an all-gather of K and V in the forward and a reduce-scatter of their gradients in the
backward. With ``distributed.cp_attention = "ring"`` (CUDA, causal only) attention runs
torch's ring SDPA on the same shards instead (:func:`..model.sequence_shard.ring_attention`).

The loss side: CP ranks' label tokens are disjoint parts of one batch, so the step sums
valid tokens and loss over dp x cp (``RuntimeContext.loss_group``) and FSDP2, sharding
over dp_shard x cp, averages gradients over dp x cp ranks (hence the step's
``loss_ranks / valid_tokens`` scale). Tokens seen and tokens/s count each token once:
``tokens_per_step`` uses the data-parallel degree, not cp.
"""

from __future__ import annotations

import torch
from torch import nn

from kforge_cli.engine.families.registry import family_of
from kforge_cli.engine.model.sequence_shard import SequenceShard, enable_ring_attention, load_balanced_indices
from kforge_cli.engine.parallel.cost_terms import Traffic, ring_share
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.runtime.mesh import sub_mesh
from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings.cp_rules import RING_CPU
from kforge_cli.settings.training import ModelSettings

SEQUENCE_KEYS = ("input_ids", "labels", "positions", "doc_ids")  # batch entries of shape [B, T]


def apply_context_parallel(module: nn.Module, runtime: RuntimeContext, *, ring: bool = False) -> bool:
    """Tell the model it runs on a sequence shard of this rank's CP group; False without CP.

    ``ring`` (``distributed.cp_attention = "ring"``): attention runs torch's ring SDPA over
    the cp mesh instead of gathering K/V (CUDA only; train.device=auto may have resolved to CPU).
    """
    if runtime.cp_size == 1:
        return False
    ring_mesh = None
    if ring:
        if runtime.device.type != "cuda":
            raise ConfigError([ConfigIssue("distributed.cp_attention", RING_CPU)], header="unsupported on CPU")
        ring_mesh = sub_mesh(runtime.mesh, "cp")
        enable_ring_attention()
    shard = SequenceShard(runtime.cp_group(), runtime.cp_size, runtime.cp_rank, ring_mesh=ring_mesh)
    hook = family_of(module).plan.cp_hook
    if hook is None:
        raise ConfigError([ConfigIssue("distributed.cp", "this model family has no context-parallel plan")])
    setattr(module, hook, shard)
    return True


def shard_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """This CP rank's part of a batch: the load-balanced chunks of every ``[B, T]`` entry.

    Without CP the batch is returned as is. Positions are added first when missing, so
    RoPE sees the global positions of the tokens this rank holds.
    """
    if cp_size == 1:
        return batch
    ids = batch["input_ids"]
    seqlen = ids.shape[1]
    out = dict(batch)
    if "positions" not in out:
        out["positions"] = torch.arange(seqlen, device=ids.device).expand(ids.shape[0], seqlen)
    index = load_balanced_indices(seqlen, cp_size, cp_rank, ids.device)
    for key in SEQUENCE_KEYS:
        if key in out:
            out[key] = out[key].index_select(1, index)
    return out


# Cost terms (pure, for the planner: engine.parallel.cost_terms).


def kv_bytes(model: ModelSettings, tokens: int, *, ring: bool, tp: int, compute_bytes: int) -> int:
    """K and V of one layer over ``tokens`` on one TP rank (its KV heads): what CP gathers per layer.

    Ring attention (``cp_attention = ring``) passes K/V repeated to the query heads (torch's ring
    kernels run without SDPA's GQA), and its default rotation all-gathers them too.
    """
    heads = model.n_heads if ring else model.kv_heads
    return 2 * tokens * heads * model.head_dim // tp * compute_bytes


def comm_terms(*, cp: int, tp: int, n_blocks: int, rerun_blocks: int, micro_batches: int, kv: int) -> list[Traffic]:
    """CP's traffic of one rank per step: per block and micro-batch the K/V all-gather forward (again
    in a recomputed forward) and the reduce-scatter of their gradients backward; ``kv`` is
    :func:`kv_bytes` of one micro-batch's whole sequences."""
    if cp <= 1:
        return []
    passes = 2 * micro_batches * n_blocks + micro_batches * rerun_blocks
    return [Traffic("cp", passes * kv * ring_share(cp), cp, tp)]


def buffer_bytes(*, cp: int, kv: int) -> int:
    """One layer's gathered K/V gradient, reduce-scattered over the CP group."""
    return kv if cp > 1 else 0
