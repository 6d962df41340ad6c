"""Async-save staging into host buffers that kforge allocates once and refills on every save.

``dcp.async_save`` needs a copy of the state that training cannot change while the
background thread writes it. :class:`HostStager` makes that copy into its own host
buffers: one per tensor of the state dict (per local shard for a DTensor), allocated at
the first save (pinned when asked and CUDA is there) and refilled in place afterwards.
It keeps nothing of torch's stager: torch 2.11's ``DefaultStager`` drops its storage
cache after every stage, 2.13's keeps it, and kforge's staging must not depend on which.

The manager stages only after the previous save finished writing, so the buffers are
never refilled while they are being written; this is the one staged copy that exists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.staging import AsyncStager

KeyPath = tuple[str | int, ...]  # the keys/indices leading to one tensor of the (nested) state dict


class HostStager(AsyncStager):
    """Stages a state dict synchronously into reusable host buffers (see the module docstring).

    `pinned`: page-locked buffers and non-blocking device-to-host copies, followed by one
    device synchronisation before :meth:`stage` returns (only with CUDA; otherwise
    ordinary host memory and blocking copies).
    """

    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self._buffers: dict[KeyPath, torch.Tensor] = {}
        self.allocations = 0  # buffers ever allocated (a steady run allocates only at its first save)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the staging buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer_ptrs(self) -> dict[KeyPath, int]:
        """Where each buffer lives (tests check that later saves refill the same memory)."""
        return {k: b.data_ptr() for k, b in self._buffers.items()}

    @torch.no_grad()
    def stage(self, state_dict: dict[str, object]) -> dict[str, object]:  # type: ignore[override]
        """A copy of `state_dict` whose tensors live in this stager's host buffers."""
        seen: dict[int, torch.Tensor] = {}  # a tensor under two keys (tied weights) is copied once
        device_copy = [False]
        staged = {k: self._copy(v, (k,), seen, device_copy) for k, v in state_dict.items()}
        if device_copy[0] and self.pinned:
            torch.cuda.synchronize()  # the non-blocking copies have landed before DCP reads them
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a complete copy."""

    def close(self) -> None:
        """Free the buffers (a write still running keeps its own references to them)."""
        self._buffers.clear()

    # ---- internals -------------------------------------------------------------------------

    def _copy(self, value: object, path: KeyPath, seen: dict[int, torch.Tensor], device_copy: list[bool]) -> object:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen[id(value)] = self._tensor(value, path, seen, device_copy)
            return seen[id(value)]
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k), seen, device_copy) for k, v in value.items()}
        if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor | dict | list | tuple) for v in value):
            items = [self._copy(v, (*path, i), seen, device_copy) for i, v in enumerate(value)]
            return items if isinstance(value, list) else type(value)(items)
        return copy.deepcopy(value)  # numbers, strings, param-group settings

    def _tensor(
        self, t: torch.Tensor, path: KeyPath, seen: dict[int, torch.Tensor], device_copy: list[bool]
    ) -> torch.Tensor:
        flatten: Callable[[], tuple[list[str], object]] | None = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) is not torch.Tensor:
            # A wrapper subclass (DTensor): stage its inner tensors, rebuild the wrapper around them
            # with the same metadata (mesh and placements stay; only the local data moves to the host).
            names, ctx = flatten()
            inner = {n: getattr(t, n) for n in names}  # tensors, and opaque members such as a DeviceMesh
            for n, v in inner.items():
                if isinstance(v, torch.Tensor):
                    inner[n] = self._tensor(v, (*path, n), seen, device_copy)
            return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())  # type: ignore[attr-defined]
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned)
            self._buffers[path] = buf
            self.allocations += 1
        non_blocking = self.pinned and t.device.type != "cpu"
        device_copy[0] |= non_blocking
        buf.copy_(t.detach(), non_blocking=non_blocking)
        return buf
