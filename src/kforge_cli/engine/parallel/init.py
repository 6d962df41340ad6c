"""Initialise a sharded model (or pipeline stages) to exactly the weights of a single-process run.

A single process builds the model on the meta device, materialises it and calls
``init_weights``, which draws every parameter from the shared RNG in a fixed order.
A sharded rank cannot do the same: a stage lacks some parameters (so the RNG stream
would shift) and random fills of a DTensor do not produce the shards of the full
tensor. Instead a *shadow* copy of the full model stays on the meta device and runs
its ``init_weights`` under a TorchFunctionMode: each in-place init op on a shadow
parameter is replayed on a real, full-size tensor on the training device (consuming
the RNG exactly as the single process does), and this rank's shard of it is copied
into the matching real parameter. At most one full parameter exists at a time, so a
70B model never materialises unsharded, and every rank ends with identical weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from kforge_cli.engine.families.registry import family_for
from kforge_cli.settings.training import ModelSettings

# Ops that only read metadata of a shadow parameter, passed through untouched.
_PASSIVE = {"dim", "size", "numel", "shape", "dtype", "device", "__get__"}


def copy_shard_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of the full tensor ``full`` into ``target`` (a DTensor shard or a plain tensor)."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            # src_data_rank=None: every rank holds the same `full`, so each slices its own shard locally.
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


class _ReplayInit(TorchFunctionMode):
    """Replays init ops on shadow (meta) parameters onto full tensors, then shards them."""

    def __init__(
        self, shadow: dict[int, tuple[str, nn.Parameter]], real: dict[str, torch.Tensor], device: torch.device
    ):
        super().__init__()
        self.shadow, self.real, self.device = shadow, real, device
        self.written: set[str] = set()
        self.last: tuple[str, torch.Tensor] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        in_kwargs = not args and "tensor" in kwargs  # torch.nn.init.* dispatch with tensor=...
        first = kwargs.get("tensor") if in_kwargs else (args[0] if args else None)
        owner = self.shadow.get(id(first)) if isinstance(first, torch.Tensor) else None
        name_of_op = getattr(func, "__name__", "")
        if owner is None or name_of_op in _PASSIVE:
            return func(*args, **kwargs)
        name, meta = owner
        if not name_of_op.endswith("_"):
            raise RuntimeError(f"sharded init cannot replay {func} on parameter {name} (not an in-place init op)")
        # Consecutive ops on one parameter (e.g. normal_ then mul_) act on the same full tensor.
        if self.last is not None and self.last[0] == name:
            full = self.last[1]
        else:
            full = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            self.last = (name, full)
        if in_kwargs:
            func(*args, **{**kwargs, "tensor": full})
        else:
            func(full, *args[1:], **kwargs)
        target = self.real.get(name)
        if target is not None:
            copy_shard_(target, full)
            self.written.add(name)
        return first


def init_sharded(
    modules: Iterable[nn.Module], cfg: ModelSettings, device: torch.device, shadow: nn.Module | None = None
) -> None:
    """Materialise ``modules`` (already parallelised, on meta) on ``device`` with single-process weights.

    ``modules`` are the model or its pipeline stages; their parameter names must be the
    full model's (``layers.<global index>...``). Call with the RNG seeded as for the
    single-process build; the RNG ends where the single-process init leaves it. ``shadow``
    is a meta-device copy of the full model (default: ``cfg``'s family's ``meta_model``; a VLM passes its own).
    """
    modules = list(modules)
    real: dict[str, torch.Tensor] = {}
    for module in modules:
        module.to_empty(device=device)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            cast(Any, module).init_weights(
                buffer_device=device
            )  # buffers (RoPE tables); parameters are overwritten below
        for name, param in module.named_parameters():
            if name in real:
                raise ValueError(f"parameter {name} is held by two pipeline stages")
            real[name] = param
    if shadow is None:
        shadow = family_for(cfg).meta_model(cfg)
    by_id = {id(p): (n, p) for n, p in shadow.named_parameters()}
    replay = _ReplayInit(by_id, real, device)
    with replay, torch.no_grad():
        cast(Any, shadow).init_weights(buffer_device=torch.device("meta"))
    missing = sorted(set(real) - replay.written)
    if missing:
        raise RuntimeError(f"sharded init did not initialise {missing[:5]} (parameter names differ from the model's)")
