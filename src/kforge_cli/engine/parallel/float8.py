"""float8 training of the Transformer's linear layers with torchao.

Each eligible ``nn.Linear`` is swapped for torchao's ``Float8Linear``: its matmuls cast
inputs, weights and output gradients to float8 with dynamic scales (tensorwise or
rowwise) and accumulate in higher precision; parameters and optimizer state keep their
dtype. The output head stays in high precision (the logits are sensitive to it), as does
any layer whose dims are not multiples of 16 (a float8 GEMM requirement).

The swap must happen *before* tensor parallelism: it replaces module objects, which
would drop the TP hooks registered on the old ones. With FSDP2 on CUDA and the
tensorwise recipe the all-gather itself runs in float8 (half the bytes of bf16).
torchao is an optional dependency (``pip install 'kforge[float8]'``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kforge_cli.errors import InvalidInputError

log = logging.getLogger("kforge")

SKIP_MODULES = ("output", "gate")  # the head, and MoE routers (routing stays in high precision)


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


def _eligible(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if fqn.split(".")[-1] in SKIP_MODULES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, *, recipe: str, fsdp_float8_all_gather: bool) -> int:
    """Swap eligible linears of ``model`` for float8 ones in place; returns how many were swapped."""
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    before = sum(1 for _, m in model.named_modules() if isinstance(m, nn.Linear))
    convert_to_float8_training(model, module_filter_fn=_eligible, config=config)
    after = sum(1 for _, m in model.named_modules() if type(m) is nn.Linear)
    swapped = before - after
    log.info("float8 (%s) on %d linear layers (%d kept in high precision)", recipe, swapped, after)
    return swapped
