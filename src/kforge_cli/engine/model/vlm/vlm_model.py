"""`VisionLanguageModel`: vision encoder -> adapter -> a language model of one of three kinds.

``vlm.arch``:

- ``joint_decoder``: the adapted visual tokens of every frame are prepended to the text
  and one causal decoder runs over ``[visual..., text...]``; logits (and the loss) are
  produced for the text positions only.
- ``cross_attention``: the residual stream holds only text; every k-th layer reads the
  visual tokens through a zero-initialised cross-attention sub-block.
- ``mot``: Mixture-of-Transformers over the joint sequence: per-modality norms, Q/K/V/O
  and MLP in every layer, one global causal attention (engine.model.vlm.mot).

Parameter names (the checkpoint contract): ``vision.*`` (encoder), ``adapter.*``, and the
text model's names ``tok_embeddings``, ``layers.<i>.*``, ``norm``, ``output``; a MoT layer
nests the dense block names under ``layers.<i>.experts.<modality>.``. ``layers`` is a
``ModuleDict`` of blocks (activation checkpointing, compile and FSDP act on it like on
the text model) and :meth:`vision_blocks` lists the encoder's blocks so they can be
sharded too. Video: ``pixel_values`` ``[B, F, C, H, W]`` with ``frame_mask`` ``[B, F]``;
each frame is encoded and adapted, F x tokens enter the sequence, padded frames are
masked out of attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.block import HeadLossFn, TransformerBlock, decoder_head_weight, init_decoder_weights
from kforge_cli.engine.model.kv_cache import KVCache
from kforge_cli.engine.model.layers import build_norm, rope_tables
from kforge_cli.engine.model.vlm.adapters import build_adapter
from kforge_cli.engine.model.vlm.cross_attention import CrossAttentionDecoderLayer
from kforge_cli.engine.model.vlm.mot import MoTBlock, build_routes
from kforge_cli.engine.model.vlm.vision import build_vision_encoder
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings
from kforge_cli.settings.vlm import AdapterSettings


def visual_modality(settings: JobSettings) -> str:
    """The MoT modality of visual tokens: ``video`` for video jobs that list it, else ``image``."""
    vlm = settings.vlm
    if settings.video is not None and vlm is not None and "video" in vlm.modalities:
        return "video"
    return "image"


class VisionLanguageModel(nn.Module):
    """See the module docstring. Built like `Transformer`: on meta, then materialised and initialised."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, settings: JobSettings) -> None:
        super().__init__()
        if settings.vlm is None or settings.vision_encoder is None:
            raise InvalidInputError("a vision-language model needs the [vlm] and [vision_encoder] sections")
        cfg, vlm = settings.model, settings.vlm
        self.cfg, self.arch = cfg, vlm.arch
        self.modalities: tuple[str, ...] = tuple(vlm.modalities) if vlm.arch == "mot" else ()
        self.visual_modality = visual_modality(settings)
        if self.arch == "mot":
            for needed in ("text", self.visual_modality):
                if needed not in self.modalities:
                    raise InvalidInputError(f"vlm.modalities {list(self.modalities)} must include {needed!r}")
        target = torch.get_default_device()
        with torch.device("meta"):  # like Transformer: torch's default inits would consume the RNG
            self.vision = build_vision_encoder(settings.vision_encoder)
            out_dim = int(self.vision.out_dim)  # type: ignore[arg-type]
            self.adapter = build_adapter(settings.adapter or AdapterSettings(), out_dim, cfg.dim)
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleDict({str(i): self._block(settings, i) for i in range(cfg.n_layers)})
            self.norm: nn.Module | None = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
            self.output: nn.Linear | None = (
                None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            )
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.tokens_per_frame: int = self.adapter.tokens_out(int(self.vision.tokens_per_frame))  # type: ignore[operator]
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    def _block(self, settings: JobSettings, index: int) -> nn.Module:
        cfg, vlm = settings.model, settings.vlm
        assert vlm is not None
        if vlm.arch == "mot":
            return MoTBlock(cfg, self.modalities)
        if vlm.arch == "cross_attention":
            return CrossAttentionDecoderLayer(cfg, with_cross_attention=index % vlm.cross_attention_every == 0)
        return TransformerBlock(cfg)

    def vision_blocks(self) -> list[nn.Module]:
        """The encoder's blocks (FSDP units of their own, like ``layers``)."""
        return list(self.vision.blocks())  # type: ignore[operator]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Encoder, adapter, embedding, blocks by index, norm, head: a fixed order of in-place inits."""
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.vision.init_weights()  # type: ignore[operator]
        self.adapter.init_weights()  # type: ignore[operator]
        init_decoder_weights(self, device)

    def head_weight(self) -> torch.Tensor | None:
        return decoder_head_weight(self)

    def encode_visual(
        self, pixel_values: torch.Tensor, frame_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, F, C, H, W]`` (or ``[B, C, H, W]``) -> visual tokens ``[B, F*N, D]`` and their mask
        ``[B, F*N]`` (True = a real frame; None when no frame is padding)."""
        if pixel_values.dim() == 4:
            pixel_values = pixel_values.unsqueeze(1)
        bsz, frames = pixel_values.shape[:2]
        feats = self.adapter(self.vision(pixel_values.flatten(0, 1)))  # [B*F, N, D]
        tokens = feats.reshape(bsz, frames * feats.shape[1], feats.shape[2])
        if frame_mask is None or bool(frame_mask.all()):
            return tokens, None
        return tokens, frame_mask.bool().repeat_interleave(feats.shape[1], dim=1)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        frame_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_fn: HeadLossFn | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, L, vocab]`` for the text positions, or ``loss_fn(hidden, head, labels)``.

        ``tokens`` ``[B, L]`` are text ids; without ``pixel_values`` the model runs on text
        alone (a MoT model then equals the dense model of its text weights). ``kv_cache``
        decodes text incrementally (generation); ``pixel_values`` may come with the first
        call only (the prefill: the visual tokens then sit in the cache before the text), and
        not for ``cross_attention``, whose every layer reads the images again (decode without
        a cache there).
        """
        if kv_cache is not None:
            visual = 0
            if pixel_values is not None:
                if self.arch == "cross_attention" or kv_cache.length:
                    raise ValueError(
                        "KV-cache decoding takes pixel_values only in the prefill, and not for cross_attention"
                    )
                if frame_mask is not None and not bool(frame_mask.all()):
                    raise ValueError("KV-cache decoding takes no padded frames")
                frames = 1 if pixel_values.dim() == 4 else pixel_values.shape[1]
                visual = frames * self.tokens_per_frame
            with kv_cache.bound(self, visual + tokens.shape[1]) as start:
                return self._forward(tokens, pixel_values, None, doc_ids, positions, labels, loss_fn, start)
        return self._forward(tokens, pixel_values, frame_mask, doc_ids, positions, labels, loss_fn, 0)

    def _forward(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None,
        frame_mask: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
        labels: torch.Tensor | None,
        loss_fn: HeadLossFn | None,
        start: int,
    ) -> torch.Tensor:
        if (labels is None) != (loss_fn is None):
            raise ValueError("pass both labels and loss_fn to get a loss, or neither to get logits")
        if doc_ids is not None or positions is not None:
            raise ValueError("vision-language batches do not use document masking (doc_ids/positions)")
        assert self.tok_embeddings is not None
        text = self.tok_embeddings(tokens)
        visual, visual_mask = (None, None)
        if pixel_values is not None:
            visual, visual_mask = self.encode_visual(pixel_values, frame_mask)
            visual = visual.to(text.dtype)
        if self.arch == "cross_attention":
            h = self._cross_attention(text, visual, visual_mask, start)
        else:
            h = self._joint(text, visual, visual_mask, start)
        assert self.norm is not None
        h = self.norm(h)
        weight = self.head_weight()
        assert weight is not None
        if loss_fn is not None and labels is not None:
            return loss_fn(h, weight, labels)
        return self.output(h) if self.output is not None else F.linear(h, weight)

    def _rope(self, seqlen: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for positions ``start .. start + seqlen - 1`` (``start`` > 0 only when decoding)."""
        if start + seqlen > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + seqlen} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        return self.rope_cos[start : start + seqlen], self.rope_sin[start : start + seqlen]

    def _joint(
        self, text: torch.Tensor, visual: torch.Tensor | None, visual_mask: torch.Tensor | None, start: int = 0
    ) -> torch.Tensor:
        """joint_decoder / mot: one causal pass over ``[visual, text]``; returns the text positions."""
        n_visual = 0 if visual is None else visual.shape[1]
        h = text if visual is None else torch.cat([visual, text], dim=1)
        bsz, seqlen = h.shape[:2]
        cos, sin = self._rope(seqlen, start)
        mask = None
        if visual_mask is not None:
            keys = torch.cat([visual_mask, visual_mask.new_ones(bsz, text.shape[1])], dim=1)
            causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=h.device).tril()
            eye = torch.eye(seqlen, dtype=torch.bool, device=h.device)  # a padded query still sees itself
            mask = ((causal & keys[:, None, :]) | eye).unsqueeze(1)
        if self.arch == "mot":
            ids = torch.full((bsz, seqlen), self.modalities.index("text"), dtype=torch.long, device=h.device)
            ids[:, :n_visual] = self.modalities.index(self.visual_modality)
            routes = build_routes(ids, self.modalities)
            for block in self.layers.values():
                h = block(h, cos, sin, mask, routes)
        else:
            for block in self.layers.values():
                h = block(h, cos, sin, mask)
        return h[:, n_visual:]

    def _cross_attention(
        self, text: torch.Tensor, visual: torch.Tensor | None, visual_mask: torch.Tensor | None, start: int = 0
    ) -> torch.Tensor:
        cos, sin = self._rope(text.shape[1], start)
        h = text
        for block in self.layers.values():
            h = block(h, cos, sin, None, visual, visual_mask)
        return h


def build_vlm(settings: JobSettings) -> VisionLanguageModel:
    """The VLM of ``settings`` on the ambient default device (``meta`` for the parallel builder)."""
    return VisionLanguageModel(settings)
