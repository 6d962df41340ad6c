"""The Llama family's model: a decoder-only Transformer of pre-norm blocks (``engine.model.block``).

Parameter names are a checkpoint contract (DCP keys, HF export, MoT conversion):
``tok_embeddings``, ``layers.<i>.{attention_norm, attention.{wq,wk,wv,wo,q_norm,k_norm},
ffn_norm, feed_forward.{w1,w2,w3}}``, ``norm``, ``output``. ``layers`` is a
``ModuleDict`` keyed by the global block index so a pipeline stage can delete the
blocks it does not own (and set ``tok_embeddings``/``norm``/``output`` to ``None``)
without renaming the ones it keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.attention_mask import build_attention_mask
from kforge_cli.engine.model.block import (
    HeadLossFn,
    TransformerBlock,
    decoder_head_weight,
    init_decoder_weights,
)
from kforge_cli.engine.model.kv_cache import KVCache
from kforge_cli.engine.model.layers import build_norm, rope_tables
from kforge_cli.engine.model.sequence_shard import SequenceShard
from kforge_cli.settings.training import ModelSettings


class Transformer(nn.Module):
    """Decoder-only Transformer configured by :class:`ModelSettings`.

    The constructor builds the modules on the meta device and then materialises them
    on the ambient default device (unless that is ``meta``) before calling
    :meth:`init_weights`. This makes the weights depend only on the RNG state at
    construction: ``torch.manual_seed(s); Transformer(cfg)`` equals building under
    ``torch.device("meta")``, ``to_empty(device=...)`` and ``init_weights()`` with
    the same seed, which is how the parallel builder creates large models.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    sequence_shard: SequenceShard | None = None  # set by the parallel builder under context parallelism

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.cfg = cfg
        target = torch.get_default_device()
        with torch.device("meta"):  # skip torch's default inits: they would consume the RNG
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
            self.norm: nn.Module | None = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
            self.output: nn.Linear | None = (
                None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            )
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Non-persistent: derived from the config, so not part of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re-)initialise every parameter and buffer this module (or pipeline stage) still has.

        Embedding and projections ~ N(0, init_std); the residual output projections
        (``attention.wo``, ``feed_forward.w2``) ~ N(0, init_std / sqrt(2 * n_layers))
        with the *full* model's ``n_layers``; norms to one; RoPE tables recomputed on
        ``buffer_device`` (default: where the buffers already are). Parameters are
        visited in a fixed order (embedding, blocks by index, norm, head) so a given
        seed always gives the same weights.
        """
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        init_decoder_weights(self, device)

    def head_weight(self) -> torch.Tensor | None:
        """The ``[vocab, dim]`` output projection (the embedding when tied), or None on a non-last stage."""
        return decoder_head_weight(self)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_fn: HeadLossFn | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]``, or the loss, or hidden states on a non-last pipeline stage.

        ``tokens`` are token ids ``[B, T]`` (or hidden states ``[B, T, D]`` when this
        stage has no embedding). ``positions`` ``[B, T]`` are RoPE positions (default
        ``0..T-1``). ``doc_ids`` ``[B, T]`` restrict attention to earlier tokens of
        the same document (packed sequences). Under context parallelism
        (``sequence_shard`` set) the inputs are this rank's shard and ``positions`` are required.
        With ``labels`` and ``loss_fn`` the
        result is ``loss_fn(normed_hidden, head_weight, labels)``, so a chunked loss
        never materialises the full logits yet still runs inside ``forward`` (where
        FSDP2's hooks keep the head weight unsharded). With ``kv_cache`` (generation) the
        tokens continue the cached positions: RoPE starts at ``kv_cache.length`` and
        attention reads the cache (see ``kv_cache``); training never passes one.
        """
        if (labels is None) != (loss_fn is None):
            raise ValueError("pass both labels and loss_fn to get a loss, or neither to get logits")
        if kv_cache is not None:
            if doc_ids is not None or positions is not None:
                raise ValueError("KV-cache decoding takes no doc_ids or positions (they follow the cache)")
            with kv_cache.bound(self, tokens.shape[1]) as start:
                pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
                return self(tokens, positions=pos, labels=labels, loss_fn=loss_fn)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1]
        if positions is None:
            if self.sequence_shard is not None:
                raise ValueError("a context-parallel shard needs its global positions (shard the batch first)")
            if seqlen > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seqlen} exceeds model.max_seq_len={self.cfg.max_seq_len}")
            cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        # Attention sees every position this rank holds: under sequence parallelism ``h`` is only
        # the TP rank's part of them (attention's input is gathered over TP), ``positions`` all.
        q_len = seqlen if positions is None else positions.shape[-1]
        mask = build_attention_mask(self.cfg.attention, (h.shape[0], q_len), h.device, doc_ids, self.sequence_shard)
        for block in self.layers.values():
            h = block(h, cos, sin, mask)
        if self.norm is None:
            return h
        h = self.norm(h)
        weight = self.head_weight()
        if weight is None:
            return h
        if loss_fn is not None and labels is not None:
            return loss_fn(h, weight, labels)
        return self.output(h) if self.output is not None else F.linear(h, weight)


__all__ = ["HeadLossFn", "Transformer", "TransformerBlock"]
