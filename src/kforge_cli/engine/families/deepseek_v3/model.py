"""DeepSeek-V3: multi-head latent attention (MLA), kforge's MoE, and multi-token prediction (MTP).

Parameter names (a checkpoint contract, as for the Llama family): the blocks are
``layers.<i>.{attention_norm, attention.{wq | wq_a, q_a_norm, wq_b}, attention.{wkv_a, kv_a_norm,
wkv_b, wo}, ffn_norm, feed_forward.*}`` (``feed_forward`` is kforge's dense MLP or
:class:`~kforge_cli.engine.model.moe.MoEFeedForward`), then ``norm`` and ``output``; the
MTP modules are ``mtp.<k>.{enorm, hnorm, eh_proj, block.*, norm}`` and share the token
embedding and the output head with the main model.

MLA (per token): the residual stream is projected down to one key/value latent of
``kv_lora_rank`` (RMS-normed) plus one rotary key of ``qk_rope_head_dim`` shared by every
head; ``wkv_b`` expands the latent into each head's key part without position
(``qk_nope_head_dim``) and its value (``v_head_dim``). Queries are projected directly
(``wq``) or through their own normed latent (``wq_a`` -> ``q_a_norm`` -> ``wq_b``) and split the
same way. A head's score is ``q_nope . k_nope + rope(q_rope) . rope(k_rope)`` over
``sqrt(qk_nope + qk_rope)`` (SDPA's default scale: DeepSeek-V3's softmax scale without
YaRN, which kforge does not implement). Generation caches the normed latent and the rotated
key, ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, and re-expands them
(:meth:`KVCache.extend_latent`).

MTP (DeepSeek-V3 section 2.2): module ``k`` (1-based) combines the previous depth's
residual stream at position ``i`` (the main model's last block for ``k = 1``) with the
embedding of token ``i + k``: ``h = eh_proj([enorm(emb(t[i+k])); hnorm(h_prev[i])])``, runs
one block (dense or MoE as block ``n_layers + k - 1`` would be) and predicts token
``i + k + 1`` through its ``norm`` and the shared head. The token ids are shifted left by
``k`` (the last ``k`` positions see wrapped-around ids; causal attention keeps them from
every earlier position, and their labels are ignored), so every depth keeps the sequence
length and the layouts of tensor and sequence parallelism. The outputs of the latest
training forward are kept in :attr:`DeepseekV3Transformer.mtp_outputs` (logits, or loss sums
when the forward computed the loss) for the step feature (``engine.train.features.mtp``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.families.llama.model import HeadLossFn, Transformer, TransformerBlock
from kforge_cli.engine.model.attention import residual_std
from kforge_cli.engine.model.attention_mask import AttentionMask, attend
from kforge_cli.engine.model.kv_cache import KVCache, attention_after, check_decoding_mask
from kforge_cli.engine.model.layers import RMSNorm, apply_rotary, build_norm, reset_norm
from kforge_cli.engine.model.mlp import FeedForward
from kforge_cli.engine.model.moe.layer import MoEFeedForward
from kforge_cli.settings.training import ModelSettings

LATENT_NORM_EPS = 1e-6
"""Epsilon of the query and key/value latent norms (DeepSeek-V3's; fixed, not ``model.norm_eps``)."""


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` (the rotary key under tensor parallelism:
    each rank's heads contribute a part of its gradient)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None  # type: ignore[attr-defined]


def tensor_parallel_group(weight: torch.Tensor) -> ProcessGroup | None:
    """The TP group a column-parallel weight is split over in this forward (None: not split). FSDP2 unshards
    a 2-D (dp, tp) parameter to its TP-only DTensor for the forward, so the mesh seen here is TP's."""
    if isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements[0].is_shard():
        return weight.device_mesh.get_group()
    return None


class MLAttention(nn.Module):
    """Multi-head latent attention (see module docstring).

    Heads are recovered with ``view(B, T, -1, ...)`` so a tensor-parallel rank works on its
    slice of heads (``wq``/``wq_b``/``wkv_b`` column-parallel, ``wo`` row-parallel, the down
    projections and latent norms replicated); the shared rotary key's gradient is then summed
    over every rank's heads, over the group ``wkv_b`` is split over (or ``key_grad_group`` when set).
    """

    kv_cache: KVCache | None = None
    key_grad_group: ProcessGroup | None = None

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError("MLAttention needs [model.mla]")
        self.n_heads = cfg.n_heads
        self.rank = mla.kv_lora_rank
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        q_out = cfg.n_heads * mla.qk_head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_a_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, mla.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        """Projections ~ N(0, std) in a fixed order; the residual output ``wo`` ~ N(0, out_std); norms to one."""
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                reset_norm(norm)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_a_norm(self.wq_a(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[B, T, D]`` -> ``[B, T, D]``; causal, or per ``mask``."""
        if isinstance(x, DTensor):
            # tensor parallelism hands in the gathered (replicated) stream: the latent down-projections
            # are plain replicated weights, and the column-parallel up-projections take a local input
            x = x.to_local()
        bsz, seqlen, _ = x.shape
        q = self.queries(x).view(bsz, seqlen, -1, self.nope + self.rope)
        q_nope, q_rope = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_rope = torch.split(self.wkv_a(x), [self.rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)
        q_rope = apply_rotary(q_rope, cos, sin)
        k_rope = apply_rotary(k_rope.unsqueeze(2), cos, sin)  # [B, T, 1, rope]: one key for all heads
        group = self.key_grad_group if self.key_grad_group is not None else tensor_parallel_group(self.wkv_b.weight)
        if group is not None:
            k_rope = _SumGradOverGroup.apply(k_rope, group)
        cache, past = self.kv_cache, 0
        if cache is not None:
            check_decoding_mask(mask)
            past = cache.length
            latent, k_rope = cache.extend_latent(self, latent, k_rope)
        keys = latent.shape[1]
        kv = self.wkv_b(latent).view(bsz, keys, -1, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        out = attend(q, k, v, mask) if cache is None else attention_after(q, k, v, past)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class DeepseekV3Block(TransformerBlock):
    """A pre-norm block with MLA: ``h = x + mla(norm(x)); out = h + ffn(norm(h))`` (dense or MoE)."""

    def __init__(self, cfg: ModelSettings, layer_id: int = 0) -> None:
        nn.Module.__init__(self)
        self.attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.attention = MLAttention(cfg)  # type: ignore[assignment]
        self.ffn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer_id)
        self.feed_forward: FeedForward | MoEFeedForward = MoEFeedForward(cfg) if moe else FeedForward(cfg)


class MTPModule(nn.Module):
    """One multi-token-prediction depth: two input norms, ``eh_proj`` ``[dim, 2 dim]``, a block, an output norm."""

    def __init__(self, cfg: ModelSettings, layer_id: int) -> None:
        super().__init__()
        self.enorm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.hnorm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = DeepseekV3Block(cfg, layer_id)
        self.norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        reset_norm(self.enorm)
        reset_norm(self.hnorm)
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=std)
        self.block.init_weights(std, out_std)
        reset_norm(self.norm)

    def forward(
        self,
        h: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | torch.Tensor | None,
    ) -> torch.Tensor:
        """The next depth's residual stream from the previous one and the embedded shifted tokens."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        return self.block(x, cos, sin, mask)


def shifted(t: torch.Tensor, k: int, fill: int | None = None) -> torch.Tensor:
    """``t`` ``[B, T]`` shifted left by ``k`` positions: wrapped around, or the last ``k`` set to ``fill``."""
    out = torch.roll(t, -k, dims=1)
    if fill is not None and k:
        out = out.clone()
        out[:, -k:] = fill
    return out


class DeepseekV3Transformer(Transformer):
    """The DeepSeek-V3 decoder: MLA blocks, kforge's MoE, and ``model.mtp_depth`` MTP modules.

    Everything else (construction on the meta device, initialisation order, pipeline stages,
    the head, the KV cache's binding, context parallelism) is :class:`Transformer`'s.
    """

    block_class = DeepseekV3Block

    def __init__(self, cfg: ModelSettings) -> None:
        self.mtp_outputs: list[torch.Tensor] = []
        self.mtp_computes_loss = False
        super().__init__(cfg)

    def build_extra_modules(self, cfg: ModelSettings) -> None:
        self.mtp: nn.ModuleDict | None = (
            nn.ModuleDict({str(k): MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth)})
            if cfg.mtp_depth
            else None
        )

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """The decoder's weights (see :meth:`Transformer.init_weights`), then the MTP modules by depth."""
        super().init_weights(buffer_device)
        if self.mtp is not None:
            std, out_std = self.cfg.init_std, residual_std(self.cfg)
            for key in sorted(self.mtp.keys(), key=int):
                cast(MTPModule, self.mtp[key]).init_weights(std, out_std)

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
        """As :meth:`Transformer.forward`; a training forward also runs the MTP modules (module docstring)."""
        if kv_cache is not None or self.mtp is None or not self.training or self.tok_embeddings is None:
            return super().forward(
                tokens, doc_ids=doc_ids, positions=positions, labels=labels, loss_fn=loss_fn, kv_cache=kv_cache
            )
        if (labels is None) != (loss_fn is None):
            raise ValueError("pass both labels and loss_fn to get a loss, or neither to get logits")
        trunk, cos, sin, mask = self.trunk(tokens, doc_ids, positions)
        # The MTP outputs are computed before the main head: FSDP2 gathers the root's parameters again
        # for the backward when the gradient reaches the root's output (the main logits), and autograd
        # runs later-created nodes first, so the main head's backward, and that gather, come first.
        self.mtp_outputs = []
        self.mtp_computes_loss = loss_fn is not None
        h = trunk
        for k in range(1, len(self.mtp) + 1):
            module = cast(MTPModule, self.mtp[str(k - 1)])
            h = module(h, self.tok_embeddings(shifted(tokens, k)), cos, sin, mask)
            normed = module.norm(h)
            weight = self.head_weight()
            assert weight is not None
            if loss_fn is not None and labels is not None:
                self.mtp_outputs.append(loss_fn(normed, weight, shifted(labels, k, IGNORE_INDEX)))
            else:
                self.mtp_outputs.append(self.output(normed) if self.output is not None else normed @ weight.t())
        return self.head(trunk, labels, loss_fn)


def mtp_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """The labels of MTP depth ``depth`` (1-based): ``labels`` shifted left, the last ``depth`` ignored."""
    return shifted(labels, depth, IGNORE_INDEX)
