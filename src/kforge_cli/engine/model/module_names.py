"""Parameter names as the model defines them, without the segments wrappers insert."""

from __future__ import annotations

# Segments that torch.compile, activation checkpointing and FSDP1 insert into parameter names.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def clean_param_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attn.wq.weight`` -> ``layers.0.attn.wq.weight``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
