"""The ``ModelFamily`` interface: what a model family gives the rest of the engine.

A family owns its modules (``families/<name>/model.py``) and says, as *data*, how the generic
machinery treats them; ``parallel/``, ``plan/``, ``interop/`` and the FLOPs count read that data
and never name a family's modules. What a family provides:

- **builder**: :meth:`ModelFamily.build` (the whole model, initialised like
  ``torch.manual_seed(s); build(cfg)`` on the default device, or left on meta under
  ``torch.device("meta")``) and :meth:`ModelFamily.build_stage` (one pipeline stage, on meta);
- **plans** (:class:`ParallelPlan`): where the blocks are (FSDP units, activation-checkpoint
  units, pipeline split points), which root modules the first and last pipeline stages keep,
  the TP/SP style of each module path (:class:`TPRule`, per block and at the root), the
  context-parallel hook, whether it has experts for expert parallelism, the float8 exclusions;
- **FLOPs**: :meth:`ModelFamily.flops_per_token` (training FLOPs per token, for MFU and ``--plan``);
- **shapes and memory terms** for the planner: :meth:`ModelFamily.activation_shapes`;
- **settings checks**: :meth:`ModelFamily.check` (exit 2 naming ``model.<field>``);
- **Hugging Face mapping**: :attr:`ModelFamily.hf` (:class:`HFMapping`, or None: no export/import).

The model protocol every family's top module follows (what the generic code calls):
``forward(tokens, *, doc_ids, positions, labels, loss_fn, kv_cache)`` (logits, the loss, or
hidden states on a non-last pipeline stage), ``init_weights(buffer_device=None)`` (a fixed
order, so a seed gives the same weights on every layout), ``head_weight()`` (the ``[vocab, dim]``
head or None), ``cfg`` (its :class:`ModelSettings`), the blocks in a ``ModuleDict`` named
:data:`BLOCKS` keyed by the *global* block index, the head (if any) a module named :data:`HEAD`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch
from torch import nn

from kforge_cli.errors import ConfigIssue

if TYPE_CHECKING:
    from pathlib import Path

    from kforge_cli.settings.training import ModelSettings

BLOCKS = "layers"
"""The ``ModuleDict`` of blocks, keyed by the global block index (FSDP/AC units, pipeline split)."""
HEAD = "output"
"""The output head module (its weight ``output.weight``), when the model has one untied."""

TPStyle = Literal[
    "colwise",  # a linear's output features split over TP; the output stays this rank's heads/units
    "rowwise",  # a linear's input features split; partial sums reduced to the residual stream's layout
    "rowwise_replicated",  # as rowwise, reduced to a replicated output (inside a replicated region)
    "gather_input",  # a module's first input: the stream's layout -> replicated (other inputs untouched)
    "replicated_input",  # a module whose input is already replicated (made a Replicate DTensor)
    "replicated_region",  # plain, all-gathered input in, plain full output out, sliced to the stream's layout
    "sequence_norm",  # a norm over the residual stream, split along the sequence under SP
    "sequence_local",  # a per-position module on the stream (replicated weights), sequence-split under SP, local out
    "heads_norm",  # a norm over each rank's local heads ([B, T, heads, head_dim]); a replicated weight
    "vocab_embedding",  # the token embedding, split over vocabulary rows (root only)
    "vocab_head",  # the output head, split over the vocabulary (loss-parallel aware; root only)
    "position_embedding",  # a replicated embedding of positions whose output joins the stream's layout (SP)
]
"""How tensor parallelism treats one module; ``parallel.tensor_parallel`` turns a style into torch's."""


@dataclass(frozen=True)
class TPRule:
    """One entry of a TP plan: the module at ``path`` (relative to a block, or to the root) gets ``style``.

    ``inputs``: how many positional inputs the module takes (``gather_input``: the first is the
    residual stream, the others pass untouched). ``sp_only``: applied only under sequence
    parallelism. ``optional``: skipped when the module is absent (e.g. a bias-free or ungated
    variant); a missing required path is an error, not a silent no-op.
    """

    path: str
    style: TPStyle
    inputs: int = 1
    sp_only: bool = False
    optional: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    """A family's parallel plans as data (see module docstring).

    ``first_stage``/``last_stage``: root modules only the first / last pipeline stage keeps
    (set to None on the others). ``tp_root``: the root's TP rules. ``cp_hook``: the attribute
    context parallelism sets to the :class:`~kforge_cli.engine.model.sequence_shard.SequenceShard`
    (None: the family has no context parallelism). ``expert_parallel``: its MoE layers
    (``engine.model.moe.MoEFeedForward``) may be split over ``distributed.ep``. ``float8_skip``:
    last name segments of linears that stay in high precision (the head, routers). ``fp32_buffers``:
    last name segments of buffers that stay fp32 when the model is cast to a lower master dtype
    (RoPE tables: long positions' angles need it).
    """

    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    tp_root: tuple[TPRule, ...]
    cp_hook: str | None = "sequence_shard"
    expert_parallel: bool = False
    float8_skip: tuple[str, ...] = (HEAD,)
    fp32_buffers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ActivationShapes:
    """The per-block shapes the planner's activation estimate reads (``plan.activations``)."""

    dim: int
    q_dim: int  # query projection width (heads x head_dim)
    kv_dim: int  # key (= value) projection width
    n_heads: int
    ffn: int  # MLP hidden width one token passes through (an MoE block: its active experts)
    ffn_local: int  # the MLP hidden width one TP rank computes
    gated: bool  # a gated MLP (SwiGLU): gate and up projections
    norm: str  # "rmsnorm" | "layernorm"
    qk_norm: bool
    block_linear_weights: int  # weight elements of one block's linears (autocast keeps a copy of each)


class HFExport(Protocol):
    """How one model's tensors and config become a Hugging Face checkpoint."""

    @property
    def hf_class(self) -> str: ...

    def name(self, key: str) -> str | None: ...

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def config(self, torch_dtype: str) -> dict[str, object]: ...


class HFMapping(Protocol):
    """A family's Hugging Face mapping: export, import and the config translation.

    ``model_types``: the HF ``config.json`` ``model_type`` values this family imports (the
    registry picks the family of an HF directory by it). The HF ``config.json`` itself is read
    by ``interop``'s one bounded reader and handed in as a dict.
    """

    model_types: tuple[str, ...]

    def export_problems(self, fields: dict[str, object]) -> list[str]: ...

    def exporter(self, fields: dict[str, object], cfg: ModelSettings) -> HFExport: ...

    def model_fields(self, config: dict[str, object]) -> dict[str, object]: ...

    def read_tensors(
        self, config: dict[str, object], files: Sequence[Path], wanted: set[str] | None, where: Path
    ) -> dict[str, torch.Tensor]: ...


class ModelFamily:
    """Base class of a model family: subclass it, set :attr:`name` and :attr:`plan`, implement
    :meth:`build`, :meth:`tp_block_plan`, :meth:`flops_per_token` and :meth:`activation_shapes`,
    and register an instance (``families.registry.register_family``)."""

    name: ClassVar[str]
    plan: ClassVar[ParallelPlan]
    hf: HFMapping | None = None

    # -- settings -------------------------------------------------------------------------
    def check(self, cfg: ModelSettings) -> list[ConfigIssue]:
        """Problems with ``cfg`` for this family (``model.<field>`` paths); none by default."""
        del cfg
        return []

    # -- builder --------------------------------------------------------------------------
    def build(self, cfg: ModelSettings) -> nn.Module:
        """The whole model (see module docstring for the initialisation contract)."""
        raise NotImplementedError

    def build_stage(self, cfg: ModelSettings, layer_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module:
        """One pipeline stage on meta: the model with only ``layer_ids`` of its blocks, the
        :attr:`ParallelPlan.first_stage` modules if ``first``, the ``last_stage`` ones if ``last``.
        Parameter names stay the full model's (``layers.<global index>...``)."""
        with torch.device("meta"):
            stage = self.build(cfg)
        blocks = stage.get_submodule(BLOCKS)
        assert isinstance(blocks, nn.ModuleDict)
        keep = {str(i) for i in layer_ids}
        for key in list(blocks.keys()):
            if key not in keep:
                del blocks[key]
        for names, kept in ((self.plan.first_stage, first), (self.plan.last_stage, last)):
            if not kept:
                for attr in names:
                    setattr(stage, attr, None)
        return stage

    def reset_buffers(self, model: nn.Module, device: torch.device | str) -> tuple[str, ...]:
        """Recompute, on ``device``, the non-persistent buffers no checkpoint holds (after ``to_empty``,
        e.g. RoPE tables, in fp32); returns their names. None by default."""
        del model, device
        return ()

    def meta_model(self, cfg: ModelSettings) -> nn.Module:
        """The whole model on the meta device (the sharded init's shadow, the planner's build)."""
        with torch.device("meta"):
            return self.build(cfg)

    # -- plans ----------------------------------------------------------------------------
    def extra_blocks(self, model: nn.Module) -> list[nn.Module]:
        """Blocks outside :data:`BLOCKS` that tensor parallelism splits like blocks (by :meth:`tp_block_plan`),
        e.g. DeepSeek-V3's multi-token-prediction blocks; none by default."""
        del model
        return []

    def tp_extra_rules(self, model: nn.Module) -> tuple[TPRule, ...]:
        """Root-relative TP rules that depend on the built model (e.g. one per MTP module); none by default."""
        del model
        return ()

    def tp_block_plan(self, block: nn.Module) -> tuple[TPRule, ...]:
        """TP rules of one block (paths relative to it); may depend on the block (dense or MoE)."""
        raise NotImplementedError

    # -- FLOPs and shapes ----------------------------------------------------------------
    def non_embedding_params(self, cfg: ModelSettings) -> int:
        """Active parameters one token's matmuls use (no embedding lookups; the head once)."""
        raise NotImplementedError

    def param_count(self, cfg: ModelSettings, *, active: bool = False) -> int:
        """Parameters of the whole model (tied ones once); ``active``: those one token uses (MoE)."""
        raise NotImplementedError

    def block_linear_params(self, cfg: ModelSettings) -> int:
        """Weight elements of one block's linear layers (what float8 runs; the planner's float8 time share)."""
        raise NotImplementedError

    def flops_per_token(self, cfg: ModelSettings, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_len``; default: the PaLM count
        ``6 N + 12 L H d T`` (``engine.model.flops``) with this family's ``N``."""
        from kforge_cli.engine.model.flops import decoder_flops_per_token

        return decoder_flops_per_token(self.non_embedding_params(cfg), cfg.n_layers, cfg.n_heads, cfg.head_dim, seq_len)

    def activation_shapes(self, cfg: ModelSettings, tp: int) -> ActivationShapes:
        """The shapes of one block for the planner's activation estimate at TP degree ``tp``."""
        raise NotImplementedError


__all__ = [
    "BLOCKS",
    "HEAD",
    "ActivationShapes",
    "HFExport",
    "HFMapping",
    "ModelFamily",
    "ParallelPlan",
    "TPRule",
    "TPStyle",
]
