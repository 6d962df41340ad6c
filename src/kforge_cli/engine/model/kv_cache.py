"""A key/value cache for incremental decoding, and the self-attention call that uses it.

Generation runs the prompt once (prefill) and then one token per step; each step's
attention reads the keys and values of all earlier positions from the cache instead of
recomputing them. The cache reaches the attention modules without changing any block's
signature: ``Transformer.forward(tokens, kv_cache=cache)`` binds it to every module
that declares a ``kv_cache`` attribute (:class:`~kforge_cli.engine.model.attention.Attention`,
the MoT block) for the duration of that call, so the text blocks, the VLM's blocks and
any block built on ``Attention`` decode with it. Training never binds a cache, and
:func:`self_attention` without one is exactly the causal SDPA call training always made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.attention_mask import AttentionMask, attend, window_causal_mask


class KVCache:
    """Keys and values ``[B, H_kv, max_len, head_dim]`` per attention module, filled left to right.

    ``length`` is the number of positions already cached; every attention module of one
    forward writes the same new positions, and the model advances ``length`` once the
    forward is done (:meth:`bound`). Storage is allocated on first use, in the dtype and
    device of the keys.
    """

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"a KV cache needs max_len >= 1, got {max_len}")
        self.max_len = max_len
        self.length = 0
        self._store: dict[int, tuple[torch.Tensor, ...]] = {}

    def extend(self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ``[B, H_kv, T, hd]`` at ``length`` for `owner`; all cached keys/values so far."""
        start, new = self.length, k.shape[2]
        if start + new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {start} + {new} do not fit")
        slot = self._store.get(id(owner))
        if slot is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            slot = (k.new_empty(shape), v.new_empty(shape))
            self._store[id(owner)] = slot
        keys, values = slot
        keys[:, :, start : start + new] = k
        values[:, :, start : start + new] = v
        return keys[:, :, : start + new], values[:, :, : start + new]

    def extend_latent(
        self, owner: nn.Module, latent: torch.Tensor, rope_key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a latent-attention module's per-token state at ``length``: the compressed key/value
        ``latent`` ``[B, T, rank]`` and the rotated key ``rope_key`` ``[B, T, 1, rope_dim]`` shared by all
        heads (DeepSeek-V3's MLA caches these, not per-head keys and values); all of them so far."""
        start, new = self.length, latent.shape[1]
        if start + new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {start} + {new} do not fit")
        slot = self._store.get(id(owner))
        if slot is None:
            slot = (
                latent.new_empty((latent.shape[0], self.max_len, *latent.shape[2:])),
                rope_key.new_empty((rope_key.shape[0], self.max_len, *rope_key.shape[2:])),
            )
            self._store[id(owner)] = slot
        latents, keys = slot
        latents[:, start : start + new] = latent
        keys[:, start : start + new] = rope_key
        return latents[:, : start + new], keys[:, : start + new]

    @contextmanager
    def bound(self, model: nn.Module, new_tokens: int) -> Iterator[int]:
        """Bind this cache to `model`'s cache-aware modules for one forward over `new_tokens` positions.

        Yields the position of the first new token; on a normal exit ``length`` advances by
        `new_tokens` (an exception leaves it unchanged: the partial write is overwritten next time).
        """
        owners = [m for m in model.modules() if hasattr(type(m), "kv_cache")]
        if not owners:
            raise ValueError(f"{type(model).__name__} has no attention module that takes a KV cache")
        if self.length + new_tokens > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {self.length} + {new_tokens} do not fit")
        for m in owners:
            m.__dict__["kv_cache"] = self  # a plain instance attribute shadowing the class's None
        try:
            yield self.length
        finally:
            for m in owners:
                m.__dict__.pop("kv_cache", None)
        self.length += new_tokens


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether `model` has attention modules that decode with a :class:`KVCache`."""
    return any(hasattr(type(m), "kv_cache") for m in model.modules())


def check_decoding_mask(mask: AttentionMask | torch.Tensor | None) -> int | None:
    """Refuse a mask while decoding with a cache (plain causal, or causal within a sliding window, is
    what the cache does itself); the window, if any."""
    if isinstance(mask, AttentionMask) and mask.kind == "causal" and mask.shard is None:
        return mask.window
    if mask is not None:
        raise ValueError("KV-cache decoding takes no attention mask (document masking is for packed training data)")
    return None


def self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask | torch.Tensor | None,
    cache: KVCache | None = None,
    owner: nn.Module | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA over ``[B, H, T, hd]`` tensors: causal, or `mask` (True = attend); with `cache`, over the cache.

    With a cache the new queries attend every cached position plus the new ones causally:
    a prefill (empty cache) is the ordinary causal call; a one-token decode step needs no
    mask and no causal flag (its single query may see every key); a multi-token chunk after
    cached positions gets an explicit mask (SDPA's ``is_causal`` aligns to the top-left). A
    sliding window always gets the explicit mask.
    """
    if cache is None:
        return attend(q, k, v, mask, scale)  # training and plain forwards: SDPA causal, dense mask, or flex
    window = check_decoding_mask(mask)
    assert owner is not None
    past = cache.length
    k, v = cache.extend(owner, k, v)
    return attention_after(q, k, v, past, window=window, scale=scale)


def attention_after(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA of new queries ``[B, H, new, hd]`` over ``past`` cached plus the new keys/values (causal,
    within ``window`` positions when given)."""
    gqa = q.shape[1] != k.shape[1]
    new = q.shape[2]
    if window is None and past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if window is None and new == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=scale)
    keys = torch.arange(past + new, device=q.device)
    chunk_mask = window_causal_mask(past + torch.arange(new, device=q.device), keys, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask, enable_gqa=gqa, scale=scale)
