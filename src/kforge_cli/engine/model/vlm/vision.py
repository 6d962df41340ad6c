"""The in-tree vision encoder: a ViT with pre-norm blocks, and the encoder factory.

Parameter names (a checkpoint contract, all under the VLM's ``vision.`` prefix):
``patch_embed``, ``pos_embed``, ``layers.<i>.{norm1, attn.{qkv, proj}, norm2, mlp.{fc1, fc2}}``,
``norm``. ``layers`` is a ``ModuleDict`` keyed by block index, like the text
Transformer's, so FSDP can make each block its own unit (see :meth:`blocks`).

Every encoder takes pixels in ``[0, 1]`` (``[N, C, H, W]``) and normalises them itself,
so the data pipeline does not need to know which encoder (and which mean/std) is used.
Initialisation uses only in-place ``nn.init`` ops on parameters so the sharded
initialiser (engine.parallel.init) can replay it shard by shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.settings.vlm import VisionEncoderSettings

VIT_INIT_STD = 0.02


class ViTAttention(nn.Module):
    """Bidirectional multi-head self-attention over the patches of one image."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class ViTMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ViTBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ViTAttention(dim, n_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ViTMLP(dim)

    def init_weights(self) -> None:
        for norm in (self.norm1, self.norm2):
            nn.init.ones_(norm.weight)
            nn.init.zeros_(norm.bias)
        for linear in (self.attn.qkv, self.attn.proj, self.mlp.fc1, self.mlp.fc2):
            nn.init.normal_(linear.weight, mean=0.0, std=VIT_INIT_STD)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


class VisionTransformer(nn.Module):
    """ViT: non-overlapping patches -> linear embedding + learned positions -> blocks -> norm.

    Reports ``tokens_per_frame`` (patches per image), ``grid`` (patches per side) and
    ``out_dim`` (feature size) so the adapter and the sequence budget need no guessing.
    """

    def __init__(self, cfg: VisionEncoderSettings) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size {cfg.image_size} is not divisible by patch_size {cfg.patch_size}")
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"vision dim {cfg.dim} is not divisible by n_heads {cfg.n_heads}")
        self.image_size, self.patch_size, self.channels = cfg.image_size, cfg.patch_size, cfg.channels
        self.grid = cfg.image_size // cfg.patch_size
        self.tokens_per_frame = self.grid**2
        self.out_dim = cfg.dim
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch_size**2, cfg.dim)
        self.pos_embed = nn.Parameter(torch.empty(self.tokens_per_frame, cfg.dim))
        self.layers = nn.ModuleDict({str(i): ViTBlock(cfg.dim, cfg.n_heads) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)

    def blocks(self) -> list[nn.Module]:
        """The encoder blocks in order (FSDP shards each as its own unit)."""
        return [self.layers[k] for k in sorted(self.layers.keys(), key=int)]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linear weights and positions ~ N(0, 0.02), biases 0, norms 1; a fixed order."""
        nn.init.normal_(self.patch_embed.weight, mean=0.0, std=VIT_INIT_STD)
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.normal_(self.pos_embed, mean=0.0, std=VIT_INIT_STD)
        for block in self.blocks():
            assert isinstance(block, ViTBlock)
            block.init_weights()
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, grid*grid, C*p*p]`` (row-major patches)."""
        n, c, h, w = pixels.shape
        if (c, h, w) != (self.channels, self.image_size, self.image_size):
            raise ValueError(
                f"images of shape {(c, h, w)} do not fit the encoder ({self.channels}, {self.image_size}, "
                f"{self.image_size}); the data pipeline resizes them to vision_encoder.image_size"
            )
        p, g = self.patch_size, self.grid
        x = pixels.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(n, g * g, c * p * p)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [0, 1] ``[N, C, H, W]`` -> features ``[N, tokens_per_frame, dim]``."""
        x = (pixels - 0.5) / 0.5
        h = self.patch_embed(self.patchify(x)) + self.pos_embed
        for block in self.blocks():
            h = block(h)
        return self.norm(h)


def build_vision_encoder(cfg: VisionEncoderSettings) -> nn.Module:
    """The encoder named by ``vision_encoder.type``: the in-tree ViT, or a local HF SigLIP/CLIP directory."""
    if cfg.type == "vit":
        return VisionTransformer(cfg)
    from kforge_cli.engine.model.vlm.hf_vision import HFVisionEncoder

    return HFVisionEncoder(cfg)
