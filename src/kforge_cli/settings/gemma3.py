"""``[model.gemma3]``: Gemma 3's attention layout (torch-free).

Absent (None) by default; ``model.family = "gemma3"`` needs it (the family fills it in with
Gemma 3's defaults when a profile leaves it out), and no other family reads it. The cross-field
rules live in :func:`gemma3_issues`, which ``settings.rules`` calls; each issue names its key.
"""

from __future__ import annotations

from typing import Protocol

from kforge_cli.errors import ConfigIssue
from kforge_cli.settings.section import Section, field


class Gemma3Settings(Section):
    """Interleaved local (sliding-window) and global layers, their RoPE bases, the attention scale."""

    head_dim: int | None = field(
        None, "Width of one attention head (None = model.dim / model.n_heads; Gemma 3 4B: 256).", gt=0
    )
    sliding_window: int | None = field(
        1024,
        "Keys a local layer attends: its own position and the window - 1 before it (None = every layer global).",
        gt=0,
    )
    global_every: int = field(
        6, "Block i attends globally when (i + 1) % global_every == 0, locally otherwise (6: 5 local : 1 global).", gt=0
    )
    rope_local_theta: float = field(10000.0, "RoPE base of the local layers (model.rope_theta: the global ones).", gt=0)
    rope_linear_factor: float = field(
        1.0, "Linear RoPE scaling of the global layers: positions divided by this (Gemma 3 4B-27B: 8).", ge=1
    )
    query_pre_attn_scalar: int | None = field(
        None, "Attention softmax scale is query_pre_attn_scalar ** -0.5 (None = the head width).", gt=0
    )
    final_logit_softcapping: float | None = field(
        None, "Cap the logits at c * tanh(logits / c) (None = off; Gemma 3 has none).", gt=0
    )

    def is_global(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based, global index) attends to every earlier position."""
        return self.sliding_window is None or (layer + 1) % self.global_every == 0

    def window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (None: global)."""
        return None if self.is_global(layer) else self.sliding_window


class Gemma3Shape(Protocol):
    """What these rules read of `ModelSettings` (a protocol, so this module need not import it)."""

    @property
    def family(self) -> str: ...

    @property
    def norm(self) -> str: ...

    @property
    def activation(self) -> str: ...

    @property
    def qk_norm(self) -> bool: ...

    @property
    def moe(self) -> object: ...

    @property
    def gemma3(self) -> Gemma3Settings | None: ...


def gemma3_issues(m: Gemma3Shape, cp_attention: str, loss_chunk_size: int = 0) -> list[ConfigIssue]:
    """Cross-field rules: ``model.gemma3`` belongs to the family; the family's fixed choices."""
    out: list[ConfigIssue] = []
    if m.family != "gemma3":
        if m.gemma3 is not None:
            out.append(ConfigIssue("model.gemma3", "is read by model.family = 'gemma3' only"))
        return out
    g = m.gemma3
    if g is None:
        out.append(ConfigIssue("model.gemma3", "model.family = 'gemma3' needs a [model.gemma3] section"))
        return out
    if g.head_dim is not None and g.head_dim % 2:
        out.append(ConfigIssue("model.gemma3.head_dim", f"{g.head_dim} must be even for RoPE"))
    if m.norm != "rmsnorm":
        out.append(ConfigIssue("model.norm", "the gemma3 family uses RMSNorm: set model.norm = 'rmsnorm'"))
    if m.activation != "gelu":
        out.append(ConfigIssue("model.activation", "the gemma3 family's MLP is GeGLU: set model.activation = 'gelu'"))
    if not m.qk_norm:
        out.append(ConfigIssue("model.qk_norm", "the gemma3 family normalises queries and keys: set it true"))
    if m.moe is not None:
        out.append(ConfigIssue("model.moe", "the gemma3 family has no MoE layers"))
    if g.final_logit_softcapping is not None and loss_chunk_size:
        out.append(
            ConfigIssue(
                "train.loss_chunk_size",
                "the chunked loss never forms the logits model.gemma3.final_logit_softcapping caps; unset one of them",
            )
        )
    if g.sliding_window is not None and cp_attention == "ring":
        out.append(
            ConfigIssue(
                "distributed.cp_attention",
                "ring attention is causal only; model.gemma3.sliding_window needs the all-gather CP attention",
            )
        )
    return out
