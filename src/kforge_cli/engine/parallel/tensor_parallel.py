"""Tensor parallelism (Megatron style) with sequence parallelism, on DTensor, from a family's TP rules.

A family says, per module path, how TP treats it (``families.base.TPRule``/``TPStyle``); this
module turns each rule into torch's ``ParallelStyle`` and applies them to the root and to every
block. In a decoder block the query/key/value projections and the MLP's gate/up are
column-parallel (each rank owns a slice of the heads / hidden units), the attention output
and the MLP's down projection row-parallel (partial sums reduced across the TP group).
With sequence parallelism the norms and the residual stream between blocks are split
along the sequence, so the all-reduce after a row-parallel layer becomes a
reduce-scatter and each rank stores 1/tp of the activations outside attention/MLP.

Mixture-of-Experts blocks (no expert-TP, as torchtitan without expert tensor parallelism):
the shared experts are split like the dense MLP (column-, then row-parallel, all-reduced:
``rowwise_replicated``); the router and the routed experts stay whole on every TP rank and run
on the all-gathered (replicated) tokens (``replicated_region``), so the TP ranks of a
data-parallel rank route the same tokens to the same experts (with ``distributed.ep``, each
TP rank exchanges them with its own EP group, made of ranks at the same TP index). Their
gradients are then complete and identical on every TP rank (nothing to sum over TP), the
expert counts are summed over the data-parallel ranks only (TP peers count the same tokens, so
summing over them would double-count) and the load-balance shares stay those of the global
batch. The price is the routed experts' FLOPs, and the all-to-all, repeated on each TP
rank. The layer's replicated output is then split to the residual's layout (``Shard(1)``
under sequence parallelism: a local slice, no communication).

The embedding is vocabulary-parallel (row-wise, ``vocab_embedding``); the output head is
column-parallel (``vocab_head``). With loss parallelism its logits stay sharded over the
vocabulary and :func:`vocab_parallel_loss_sum` computes the cross-entropy (and z-loss) without
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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.families.base import BLOCKS, ModelFamily, TPRule
from kforge_cli.engine.families.registry import DEFAULT_FAMILY, family_of, get_family

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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


def _present(root: nn.Module, path: str) -> bool:
    """Whether ``path`` names a module under ``root`` (a pipeline stage sets the ones it lacks to None)."""
    try:
        return isinstance(root.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def torch_style(
    rule: TPRule, *, sequence_parallel: bool, loss_parallel_on: bool = False, float8_recipe: str | None = None
) -> ParallelStyle:
    """torch's ParallelStyle for one family TP rule (see ``families.base.TPStyle``)."""
    colwise, rowwise, prepare_input = _styles(float8_recipe)
    stream = Shard(1) if sequence_parallel else Replicate()
    rest = (None,) * (rule.inputs - 1)
    style = rule.style
    if style == "colwise":
        return colwise()
    if style == "rowwise":
        return rowwise(output_layouts=stream)
    if style == "rowwise_replicated":
        return rowwise(output_layouts=Replicate())
    if style == "gather_input":
        return prepare_input(input_layouts=(stream, *rest), desired_input_layouts=(Replicate(), *rest))
    if style == "replicated_input":
        return prepare_input(input_layouts=(Replicate(), *rest), desired_input_layouts=(Replicate(), *rest))
    if style == "replicated_region":
        # Routed experts (see module docstring): a plain, all-gathered tensor in (the router needs every
        # token; a DTensor would not mix with its plain weights), a plain full one out, sliced to the
        # stream. Its input gradient is complete on every TP rank: the routed path's by construction,
        # the shared experts' because their input is made a Replicate DTensor once (replicated_input),
        # whose Partial gradient is all-reduced once on the way back to the plain tensor.
        return PrepareModuleInputOutput(
            input_layouts=(stream, *rest),
            desired_input_layouts=(Replicate(), *rest),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(stream,),
            use_local_output=True,
        )
    if style == "sequence_norm":
        return SequenceParallel()
    if style == "sequence_local":
        return SequenceParallel(use_local_output=True)
    if style == "heads_norm":
        # A norm over each rank's local heads ([B, T, heads, head_dim]): a replicated DTensor weight
        # over a head-sharded input gets its gradient summed over TP.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if style == "vocab_head":
        return ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
            use_local_output=not loss_parallel_on,
        )
    if style == "position_embedding":
        # Every rank looks up all positions with its whole (replicated) table and keeps its slice of the
        # stream; the backward all-gathers the output gradient, so the table's gradient is complete.
        return PrepareModuleOutput(
            output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=True
        )
    raise ValueError(f"unknown TP style {style!r} (module {rule.path})")


def plan_of(
    root: nn.Module,
    rules: tuple[TPRule, ...],
    *,
    sequence_parallel: bool,
    loss_parallel_on: bool = False,
    float8_recipe: str | None = None,
) -> dict[str, ParallelStyle]:
    """The parallelize_module plan of ``root`` from a family's rules (absent optional modules skipped)."""
    plan: dict[str, ParallelStyle] = {}
    for rule in rules:
        if rule.sp_only and not sequence_parallel:
            continue
        if not _present(root, rule.path):
            if rule.optional:
                continue
            raise ValueError(f"the TP plan names {rule.path!r}, which {type(root).__name__} does not have")
        plan[rule.path] = torch_style(
            rule, sequence_parallel=sequence_parallel, loss_parallel_on=loss_parallel_on, float8_recipe=float8_recipe
        )
    return plan


def block_plan(
    block: nn.Module,
    *,
    sequence_parallel: bool,
    float8_recipe: str | None = None,
    family: ModelFamily | None = None,
) -> dict[str, ParallelStyle]:
    """The parallelize_module plan of one block (``float8_recipe`` None: no float8; ``family`` None: the default)."""
    family = family if family is not None else get_family(DEFAULT_FAMILY)
    rules = family.tp_block_plan(block)
    return plan_of(block, rules, sequence_parallel=sequence_parallel, float8_recipe=float8_recipe)


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
    """Shard ``model`` (a family's model or one pipeline stage of it) over ``tp_mesh`` in place, by its
    family's TP rules (``model.cfg.family``)."""
    family = family_of(model)
    root = plan_of(model, family.plan.tp_root, sequence_parallel=sequence_parallel, loss_parallel_on=loss_parallel_on)
    parallelize_module(model, tp_mesh, root)
    for rule in family.plan.tp_root:
        if rule.style == "vocab_embedding" and rule.path in root:
            model.get_submodule(rule.path).register_forward_hook(_wait_on_output)
    for block in cast(nn.ModuleDict, model.get_submodule(BLOCKS)).values():
        plan = block_plan(block, sequence_parallel=sequence_parallel, float8_recipe=float8_recipe, family=family)
        parallelize_module(block, tp_mesh, plan)
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
