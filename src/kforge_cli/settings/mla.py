"""``[model.mla]``: DeepSeek-V3's multi-head latent attention (torch-free).

Set only for ``model.family = "deepseek_v3"``. Keys and values are compressed into one
latent of ``kv_lora_rank`` per token (what a generation cache holds, with the shared
RoPE key); queries optionally through a latent of ``q_lora_rank``. Each head's query/key
has a part without position (``qk_nope_head_dim``) and a rotary part
(``qk_rope_head_dim``, one key shared by all heads); values have ``v_head_dim``.
"""

from __future__ import annotations

from typing import Protocol

from kforge_cli.errors import ConfigIssue
from kforge_cli.settings.section import Section, field


class MLASettings(Section):
    """Multi-head latent attention: the latent ranks and the per-head dimensions."""

    kv_lora_rank: int = field(512, "Rank of the compressed key/value latent (what the KV cache holds per token).", gt=0)
    q_lora_rank: int | None = field(
        None, "Rank of the query latent (None = queries projected directly from the residual stream).", gt=0
    )
    qk_rope_head_dim: int = field(64, "Rotary part of each query/key head (the key part shared by all heads).", gt=0)
    qk_nope_head_dim: int = field(128, "Part of each query/key head without position encoding.", gt=0)
    v_head_dim: int = field(128, "Value head dimension.", gt=0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_params(self, dim: int, n_heads: int) -> int:
        """Parameters of one MLA module: q (direct, or down + norm + up), kv down + norm, kv up, output."""
        q = dim * n_heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            q = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n_heads * self.qk_head_dim
        kv_down = dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_up = self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + n_heads * self.v_head_dim * dim


class FamilyShape(Protocol):
    """What these rules read of `ModelSettings`."""

    @property
    def family(self) -> str: ...

    @property
    def mla(self) -> MLASettings | None: ...

    @property
    def mtp_depth(self) -> int: ...

    @property
    def n_kv_heads(self) -> int | None: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def qk_norm(self) -> bool: ...

    @property
    def norm(self) -> str: ...

    @property
    def activation(self) -> str: ...


def deepseek_v3_issues(m: FamilyShape) -> list[ConfigIssue]:
    """Cross-field rules of ``model.family``, ``[model.mla]`` and ``model.mtp_depth``."""
    out: list[ConfigIssue] = []
    if m.family != "deepseek_v3":
        if m.mla is not None:
            out.append(
                ConfigIssue("model.mla", 'is for model.family = "deepseek_v3"; drop [model.mla] or set the family')
            )
        if m.mtp_depth:
            out.append(
                ConfigIssue("model.mtp_depth", 'multi-token prediction is built for model.family = "deepseek_v3"')
            )
        return out
    if m.mla is None:
        out.append(ConfigIssue("model.mla", 'model.family = "deepseek_v3" needs a [model.mla] section'))
    elif m.mla.qk_rope_head_dim % 2:
        out.append(ConfigIssue("model.mla.qk_rope_head_dim", f"{m.mla.qk_rope_head_dim} must be even for RoPE"))
    if m.n_kv_heads not in (None, m.n_heads):
        out.append(
            ConfigIssue("model.n_kv_heads", "MLA gives every head its own key and value; leave it unset (= n_heads)")
        )
    if m.qk_norm:
        out.append(ConfigIssue("model.qk_norm", "MLA normalises its latents instead; set qk_norm = false"))
    if m.norm != "rmsnorm":
        out.append(ConfigIssue("model.norm", "DeepSeek-V3 uses rmsnorm"))
    if m.activation != "swiglu":
        out.append(ConfigIssue("model.activation", "DeepSeek-V3 uses swiglu"))
    return out
