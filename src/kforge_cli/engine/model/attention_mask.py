"""Attention backends and the per-batch mask every layer shares.

``model.attention`` picks the kernel:

- ``sdpa``: ``F.scaled_dot_product_attention``; plain causal attention uses ``is_causal``
  (flash / memory-efficient kernels on GPU), document masking a dense boolean
  ``[B, 1, T, T]`` mask (on GPU that rules the flash kernel out and, with GQA, the
  memory-efficient one too: the math kernel stores ``B x H x T^2`` per layer).
- ``flex``: FlexAttention with a block mask built from the document ids (causal within a
  document); fully masked tiles are skipped, so packed documents cost what their own
  lengths cost. ``flex_attention`` is compiled once per process (on CUDA).
- ``auto``: flex on CUDA when the batch has document ids or is a context-parallel shard
  (whose local queries against the gathered keys need a mask), sdpa otherwise. On CPU
  FlexAttention has no backward (torch 2.13), so those cases keep the dense path.

:func:`build_attention_mask` runs once per forward (batch); the :class:`AttentionMask` it
returns is passed to every layer, so a block mask is built once, not once per layer.
Under context parallelism (:mod:`.sequence_shard`) the queries are this rank's tokens and
the keys the gathered full sequence; the masks then compare global positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from kforge_cli.engine.model.sequence_shard import (
    SequenceShard,
    gather_sequence,
    gather_sequence_ids,
    ring_attention,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

AttentionBackend = Literal["sdpa", "flex", "auto"]
MaskKind = Literal["causal", "dense", "flex", "ring"]  # ring: torch's context-parallel SDPA

_compiled_flex: Callable[..., object] | None = None  # its result is checked to be a tensor
_compiled_block_mask: Callable[..., BlockMask] | None = None


@dataclass
class AttentionMask:
    """What one forward's layers attend with: causal (``is_causal``), a dense mask, or a block mask."""

    kind: MaskKind
    dense: torch.Tensor | None = None  # [B or 1, 1, Tq, Tk] bool, True = attend
    block_mask: BlockMask | None = None
    shard: SequenceShard | None = None  # gather K/V over this CP group before attending
    window: int | None = None  # sliding window: a query sees keys q - window < k <= q (global positions)


def resolve_backend(
    backend: AttentionBackend, device: torch.device, documents: bool, sharded: bool = False
) -> Literal["sdpa", "flex"]:
    """The kernel ``auto`` stands for: flex on CUDA with document masking or a CP shard, else sdpa."""
    if backend != "auto":
        return backend
    return "flex" if device.type == "cuda" and (documents or sharded) else "sdpa"


def flex_attention_fn(device: torch.device) -> Callable[..., object]:
    """``flex_attention``: compiled once per process on CUDA; eager elsewhere (CPU: forward only).

    Eager flex materialises the scores (correct, not fast); compiling it on CPU costs ~30 s
    per process for a path that can only run without gradients.
    """
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, T, T]``: True where query ``i`` may attend key ``j``.

    ``j <= i`` and both tokens belong to the same document, so packed documents
    never see each other. The diagonal is always True, so no row is fully masked.
    """
    seqlen = doc_ids.shape[1]
    same_doc = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def window_causal_mask(q_index: torch.Tensor, k_index: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean ``[Tq, Tk]``: key ``k`` at or before query ``q`` (global positions) and, with a
    ``window``, fewer than ``window`` positions back (``q - window < k <= q``, transformers' rule)."""
    keep = k_index[None, :] <= q_index[:, None]
    if window is not None:
        keep = keep & (k_index[None, :] > q_index[:, None] - window)
    return keep


def _flex_block_mask(
    q_index: torch.Tensor | None,
    k_index: torch.Tensor | None,
    q_docs: torch.Tensor | None,
    k_docs: torch.Tensor | None,
    batch: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    window: int | None = None,
) -> BlockMask:
    """A BlockMask for causal (within-document, within-``window``) attention; indices map local to
    global positions.

    On CUDA ``create_block_mask`` is compiled once per process (torch 2.13 deprecates its
    ``_compile`` flag, which wraps a fresh ``torch.compile`` on every call): eager, it would
    materialise the full ``B x Tq x Tk`` mask of every batch to find the blocks.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    global _compiled_block_mask
    make = create_block_mask
    if device.type == "cuda":
        if _compiled_block_mask is None:
            _compiled_block_mask = torch.compile(create_block_mask)
        make = _compiled_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        gq = q if q_index is None else q_index[q]
        gk = kv if k_index is None else k_index[kv]
        keep = gk <= gq
        if window is not None:
            keep = keep & (gk > gq - window)
        if q_docs is not None and k_docs is not None:
            keep = keep & (q_docs[b, q] == k_docs[b, kv])
        return keep

    docs = q_docs is not None
    return make(mask_mod, batch if docs else None, None, q_len, k_len, device=device)


def build_attention_mask(
    backend: AttentionBackend,
    tokens_shape: tuple[int, int],
    device: torch.device,
    doc_ids: torch.Tensor | None = None,
    shard: SequenceShard | None = None,
    window: int | None = None,
) -> AttentionMask:
    """The mask of one batch ``[B, T_local]``: document-causal when ``doc_ids`` is given, else causal;
    with ``window`` also a sliding window (a key fewer than ``window`` positions before the query,
    global positions under context parallelism). A windowed mask without documents or a shard is
    kind ``causal`` with its dense ``[1, 1, T, T]`` mask (a KV cache re-derives it per step)."""
    batch, q_len = tokens_shape
    if shard is not None and shard.ring_mesh is not None:  # validated: causal only, SDPA, CUDA
        if doc_ids is not None or window is not None:
            raise ValueError("ring attention (distributed.cp_attention = 'ring') takes no document or window mask")
        return AttentionMask("ring", shard=shard)
    kernel = resolve_backend(backend, device, doc_ids is not None or window is not None, shard is not None)
    if shard is None:
        if kernel == "flex":
            bm = _flex_block_mask(None, None, doc_ids, doc_ids, batch, q_len, q_len, device, window)
            return AttentionMask("flex", block_mask=bm, window=window)
        if doc_ids is None:
            if window is None:
                return AttentionMask("causal")
            pos = torch.arange(q_len, device=device)
            return AttentionMask("causal", dense=window_causal_mask(pos, pos, window)[None, None], window=window)
        dense = document_causal_mask(doc_ids)
        if window is not None:
            pos = torch.arange(q_len, device=device)
            dense = dense & window_causal_mask(pos, pos, window)[None, None]
        return AttentionMask("dense", dense=dense, window=window)
    q_index = shard.query_index(q_len, device)
    k_index = shard.key_index(q_len, device)
    k_docs = gather_sequence_ids(doc_ids, shard) if doc_ids is not None else None
    if kernel == "flex":
        bm = _flex_block_mask(q_index, k_index, doc_ids, k_docs, batch, q_len, k_index.numel(), device, window)
        return AttentionMask("flex", block_mask=bm, shard=shard, window=window)
    dense = window_causal_mask(q_index, k_index, window).unsqueeze(0)  # [1, Tq, Tk]
    if doc_ids is not None and k_docs is not None:
        dense = dense & (doc_ids.unsqueeze(2) == k_docs.unsqueeze(1))
    return AttentionMask("dense", dense=dense.unsqueeze(1), shard=shard, window=window)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask | torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """``[B, H, Tq, hd]`` attention output for q ``[B, H, Tq, hd]``, k/v ``[B, Hkv, Tk, hd]``.

    ``mask`` is an :class:`AttentionMask`, a plain boolean tensor (True = attend; the VLM
    paths build their own), or None for causal attention. ``scale``: the softmax scale
    (None: ``head_dim ** -0.5``).
    """
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    if mask.kind == "ring" and mask.shard is not None:
        if scale is not None:
            raise ValueError("ring attention takes no softmax scale")
        return ring_attention(q, k, v, mask.shard)
    if mask.shard is not None:
        k = gather_sequence(k, mask.shard, dim=2)
        v = gather_sequence(v, mask.shard, dim=2)
    if mask.kind == "causal" and mask.dense is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if mask.kind in ("dense", "causal"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa, scale=scale)
    out = flex_attention_fn(q.device)(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa, scale=scale)
    assert isinstance(out, torch.Tensor)
    return out
