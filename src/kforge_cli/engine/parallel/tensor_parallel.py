"""Tensor parallelism (Megatron style) with sequence parallelism, on DTensor.

Per block: Q/K/V and the MLP's gate/up (``w1``/``w3``) are column-parallel (each rank
owns a slice of the heads / hidden units), the attention output ``wo`` and the MLP's
down projection ``w2`` are row-parallel (partial sums reduced across the TP group).
With sequence parallelism the norms and the residual stream between blocks are split
along the sequence, so the all-reduce after a row-parallel layer becomes a
reduce-scatter and each rank stores 1/tp of the activations outside attention/MLP.

Mixture-of-Experts blocks (no expert-TP, as torchtitan without expert tensor parallelism):
the shared experts are split like the dense MLP (``w1``/``w3`` column-, ``w2`` row-parallel,
all-reduced); the router and the routed experts stay whole on every TP rank and run on
the all-gathered (replicated) tokens, so the TP ranks of a data-parallel rank route the
same tokens to the same experts (with ``distributed.ep``, each TP rank exchanges them
with its own EP group, made of ranks at the same TP index). Their gradients are then
complete and identical on every TP rank (nothing to sum over TP), the expert counts are
summed over the data-parallel ranks only (TP peers count the same tokens, so summing
over them would double-count) and the load-balance shares stay those of the global
batch. The price is the routed experts' FLOPs, and the all-to-all, repeated on each TP
rank. The layer's replicated output is then split to the residual's layout (``Shard(1)``
under sequence parallelism: a local slice, no communication).

The embedding is vocabulary-parallel (row-wise); the output head is column-parallel.
With loss parallelism its logits stay sharded over the vocabulary and
:func:`vocab_parallel_loss_sum` computes the cross-entropy (and z-loss) without
gathering them.

The residual stream stays a *local* tensor of ``T/tp`` positions under sequence
parallelism, so the model cannot derive RoPE positions from its input length; a
forward pre-hook on the root passes explicit ``positions`` (``0..T-1``) instead.

The embedding's output leaves its reduction as an ``AsyncCollectiveTensor`` (a wrapper
that waits on first use). Handed as is into a ``torch.compile``-d block, the compiled
backward loses its gradient: the embedding's weight got none (measured on gloo with the
``aot_eager`` and ``inductor`` backends, torch 2.13). A forward hook waits on it first,
through the differentiable ``wait_tensor`` op, so every block receives a plain tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.model.moe import MoEFeedForward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Linear layers of a block by how TP splits them (block_plan; float8 eligibility reads the same split).
COLWISE_LINEARS = ("wq", "wk", "wv", "w1", "w3")  # output features split over the TP ranks
ROWWISE_LINEARS = ("wo", "w2")  # input features split over the TP ranks


def _styles(float8_recipe: str | None) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) styles for the blocks' linears.

    torchao's float8 styles cast activations to float8 *tensorwise* before the collectives,
    which only the tensorwise recipe can consume: a rowwise ``Float8Linear`` handed such an
    input calls ``_scaled_mm`` with a scalar and a ``(1, N)`` scale and fails. Rowwise float8
    (and no float8) therefore use the plain styles, and its linears cast after the collective.
    """
    if float8_recipe == "tensorwise":
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def block_plan(
    block: nn.Module, *, sequence_parallel: bool, float8_recipe: str | None = None
) -> dict[str, ParallelStyle]:
    """The parallelize_module plan of one TransformerBlock (``float8_recipe`` None: no float8)."""
    colwise, rowwise, prepare_input = _styles(float8_recipe)
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention": prepare_input(
            input_layouts=(stream, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "attention.wo": rowwise(output_layouts=stream),
    }
    attention = block.get_submodule("attention")
    if hasattr(attention, "wkv_b"):  # latent attention (DeepSeek-V3): heads split in the up-projections only
        plan["attention.wkv_b"] = colwise()
        plan["attention.wq_b" if getattr(attention, "wq", None) is None else "attention.wq"] = colwise()
    else:
        plan.update({"attention.wq": colwise(), "attention.wk": colwise(), "attention.wv": colwise()})
    if isinstance(block.feed_forward, MoEFeedForward):
        plan.update(moe_plan(block.feed_forward, stream, colwise, rowwise, prepare_input))
    else:
        plan["feed_forward"] = prepare_input(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        plan["feed_forward.w1"] = colwise()
        plan["feed_forward.w2"] = rowwise(output_layouts=stream)
        if getattr(block.feed_forward, "w3", None) is not None:
            plan["feed_forward.w3"] = colwise()
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    if getattr(block.attention, "q_norm", None) is not None:
        # QK-norm weights act on each rank's local heads ([B, T, heads, head_dim]): a
        # replicated DTensor weight over a head-sharded input gets its gradient summed over TP.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def moe_plan(
    layer: MoEFeedForward, stream: Placement, colwise: type, rowwise: type, prepare_input: type
) -> dict[str, ParallelStyle]:
    """The plan of an MoE feed-forward (see module docstring): TP over the shared experts only.

    The layer gets a plain, all-gathered tensor (the router needs every token of the
    sequence; a DTensor would not mix with its plain weights) and returns a plain full
    one, which is sliced to ``stream``. Its input gradient is complete on every TP rank:
    the routed path's by construction, the shared experts' because their input is made a
    ``Replicate`` DTensor once, whose ``Partial`` gradient (``w1`` and ``w3`` summed) is
    all-reduced once on the way back to the plain tensor.
    """
    plan: dict[str, ParallelStyle] = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(stream,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(stream,),
            use_local_output=True,
        )
    }
    if layer.shared_experts is not None:
        plan["feed_forward.shared_experts"] = prepare_input(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        )
        plan["feed_forward.shared_experts.w1"] = colwise()
        plan["feed_forward.shared_experts.w2"] = rowwise(output_layouts=Replicate())
        if layer.shared_experts.w3 is not None:
            plan["feed_forward.shared_experts.w3"] = colwise()
    return plan


def _root_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel_on: bool) -> dict[str, ParallelStyle]:
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
            use_local_output=not loss_parallel_on,
        )
    return plan


def _inject_positions(
    module: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]
) -> tuple[tuple[torch.Tensor, ...], dict[str, object]] | None:
    """Pass explicit RoPE positions when the input is token ids (see module docstring)."""
    del module
    if kwargs.get("positions") is None and args and args[0].dim() == 2:
        tokens = args[0]
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return args, {**kwargs, "positions": positions}
    return None


def _wait_on_output(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
    """A plain tensor for the blocks (see module docstring); ``wait_tensor``'s gradient is the identity."""
    del module, args
    return wait_tensor(output) if isinstance(output, AsyncCollectiveTensor) else output


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel_on: bool,
    float8_recipe: str | None = None,
) -> None:
    """Shard ``model`` (a Transformer or one pipeline stage of it) over ``tp_mesh`` in place."""
    parallelize_module(
        model, tp_mesh, _root_plan(model, sequence_parallel=sequence_parallel, loss_parallel_on=loss_parallel_on)
    )
    embedding = getattr(model, "tok_embeddings", None)
    if embedding is not None:
        embedding.register_forward_hook(_wait_on_output)
    blocks = list(cast(nn.ModuleDict, model.layers).values())
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # DeepSeek-V3's multi-token-prediction modules: a block each, plus their own norms
        for module in mtp.values():
            blocks.append(module.block)
            if sequence_parallel:
                # the stream is split along the sequence: the norms and the eh_proj projection act per
                # position, with replicated weights whose gradients are summed over the TP ranks
                parallelize_module(
                    module,
                    tp_mesh,
                    {name: SequenceParallel(use_local_output=True) for name in ("enorm", "hnorm", "eh_proj", "norm")},
                )
    for block in blocks:
        parallelize_module(
            block, tp_mesh, block_plan(block, sequence_parallel=sequence_parallel, float8_recipe=float8_recipe)
        )
        attention = block.get_submodule("attention")
        if hasattr(attention, "key_grad_group"):  # latent attention's shared rotary key (see block_plan)
            attention.__dict__["key_grad_group"] = tp_mesh.get_group()
    if sequence_parallel:
        model.register_forward_pre_hook(_inject_positions, with_kwargs=True)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward.

    The loss built from the sum is replicated: every TP rank back-propagates the same
    gradient, which is already the gradient of each rank's contribution.
    """

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def vocab_parallel_loss_sum(logits: DTensor, labels: torch.Tensor, z_loss_weight: float = 0.0) -> torch.Tensor:
    """``cross_entropy_sum`` (+ z-loss) from logits sharded over the vocabulary, never gathering them.

    Each rank holds ``V/tp`` columns. The log-partition is ``log(sum_r sum_v exp(l - m)) + m``
    with ``m`` the global max (a constant for the gradient), and the target logit comes from
    the one rank whose slice holds the label; both are summed over the TP group. The result
    is the same replicated scalar on every TP rank.
    """
    if not isinstance(logits, DTensor) or not logits.placements[0].is_shard(logits.ndim - 1):
        raise TypeError("vocab_parallel_loss_sum expects logits as a DTensor sharded on the last (vocab) dim")
    mesh = logits.device_mesh
    group = mesh.get_group()
    local = logits.to_local().float()
    local = local.reshape(-1, local.shape[-1])
    flat_labels = labels.reshape(-1)
    width = local.shape[-1]
    start = mesh.get_local_rank() * width
    with torch.no_grad():
        m = local.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sumexp = _SumOverGroup.apply(torch.exp(local - m.unsqueeze(-1)).sum(-1), group)
    lse = torch.log(sumexp) + m
    valid = flat_labels != IGNORE_INDEX
    mine = valid & (flat_labels >= start) & (flat_labels < start + width)
    idx = torch.where(mine, flat_labels - start, torch.zeros_like(flat_labels))
    target_local = torch.where(mine, local.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lse))
    target = _SumOverGroup.apply(target_local, group)
    per_token = lse - target
    if z_loss_weight:
        per_token = per_token + z_loss_weight * lse.square()
    return torch.where(valid, per_token, torch.zeros_like(per_token)).sum()
