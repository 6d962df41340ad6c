"""float8 training of a model's linear layers with torchao.

Each eligible ``nn.Linear`` is swapped for torchao's ``Float8Linear``: its matmuls cast
inputs, weights and output gradients to float8 with dynamic scales (tensorwise or
rowwise) and accumulate in higher precision; parameters and optimizer state keep their
dtype. The linears the family lists in ``plan.float8_skip`` stay in high precision (the head:
the logits are sensitive to it; routers), as does any layer whose dims are not multiples of 16
(a float8 GEMM requirement). Under tensor parallelism the GEMM runs on each rank's shard, so it
is the shard's dims that must be multiples of 16 (a column-parallel layer's outputs / tp, a
row-parallel one's inputs / tp), read from the family's TP rules.

The swap must happen *before* tensor parallelism: it replaces module objects, which
would drop the TP hooks registered on the old ones. With FSDP2 on CUDA and the
tensorwise recipe the all-gather itself runs in float8 (half the bytes of bf16); its
weight scales are then computed for all layers at once, in one all-reduce, right after
each optimizer step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) instead of
one amax all-reduce per weight per all-gather. torchao is an optional dependency (``pip install 'kforge[float8]'``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.engine.families.registry import DEFAULT_FAMILY, family_of, get_family
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.training import TrainSettings

log = logging.getLogger("kforge")


def require_torchao() -> None:
    """Raise a clear error when train.float8 is on but torchao is not installed."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    if not torch.cuda.is_available():  # its CUDA kernels cannot load on a CPU build: expected, not news
        quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise InvalidInputError(
            "train.float8 = true needs torchao: pip install torchao (or 'kforge[float8]'), or set --train.float8=false"
        ) from exc
    finally:
        quiet.setLevel(level)


def linear_splits(model: nn.Module) -> dict[str, str]:
    """``fqn -> "colwise" | "rowwise"`` of every block linear the model's family TP rules split."""
    family = family_of(model)
    out: dict[str, str] = {}
    for key, block in model.get_submodule(BLOCKS).named_children():
        for rule in family.tp_block_plan(block):
            if rule.style == "colwise":
                out[f"{BLOCKS}.{key}.{rule.path}"] = "colwise"
            elif rule.style in ("rowwise", "rowwise_replicated"):
                out[f"{BLOCKS}.{key}.{rule.path}"] = "rowwise"
    return out


def gemm_dims_per_rank(linear: nn.Linear, fqn: str, tp: int, splits: dict[str, str]) -> tuple[int, int]:
    """(in, out) features of the GEMM this rank runs: a TP-split linear's shard, else the whole layer."""
    in_features, out_features = linear.in_features, linear.out_features
    split = splits.get(fqn) if tp > 1 else None
    if split == "colwise":
        out_features //= tp
    elif split == "rowwise":
        in_features //= tp
    return in_features, out_features


def float8_filter(
    tp: int = 1, splits: dict[str, str] | None = None, skip: tuple[str, ...] | None = None
) -> Callable[[nn.Module, str], bool]:
    """Which linears become float8: not one the family keeps in high precision (``skip``, default the
    default family's), and per-rank GEMM dims multiples of 16 (``splits``: :func:`linear_splits`, needed when tp > 1)."""
    if tp > 1 and splits is None:
        raise ValueError("float8_filter under TP needs the model's linear_splits")
    skipped = skip if skip is not None else get_family(DEFAULT_FAMILY).plan.float8_skip
    split_of = splits or {}

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in skipped:
            return False
        in_features, out_features = gemm_dims_per_rank(module, fqn, tp, split_of)
        return in_features % 16 == 0 and out_features % 16 == 0

    return eligible


def fsdp_float8_all_gather(train: TrainSettings, runtime: RuntimeContext) -> bool:
    """Whether FSDP2 all-gathers the float8 weights in float8: tensorwise recipe, sharded over CUDA ranks."""
    sharded = runtime.world_size > 1 and runtime.dims.dp_shard > 1
    return train.float8 and train.float8_recipe == "tensorwise" and sharded and runtime.device.type == "cuda"


def precompute_scales_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """After every ``optimizer.step()``: all float8 weights' scales in one all-reduce (see module docstring).

    A skipped step (NaN policy) changes no weight, so the scales computed after the last
    real step stay right; a post-hook runs exactly when the weights changed.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        del opt, args, kwargs
        precompute_float8_dynamic_scale_for_fsdp(model)

    return optimizer.register_step_post_hook(hook)


def apply_float8(
    model: nn.Module,
    *,
    recipe: str,
    fsdp_float8_all_gather: bool,
    tp: int = 1,
    skip: tuple[str, ...] | None = None,
) -> int:
    """Swap eligible linears of ``model`` for float8 ones in place; returns how many were swapped.

    ``skip``: the linear names kept in high precision; by default those of the model's family
    (``plan.float8_skip``), which a module no family built must pass itself.
    """
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    before = sum(1 for _, m in model.named_modules() if isinstance(m, nn.Linear))
    splits = linear_splits(model) if tp > 1 else None
    keep = float8_filter(tp, splits, skip if skip is not None else family_of(model).plan.float8_skip)
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    after = sum(1 for _, m in model.named_modules() if type(m) is nn.Linear)
    swapped = before - after
    log.info("float8 (%s) on %d linear layers (%d kept in high precision)", recipe, swapped, after)
    return swapped
