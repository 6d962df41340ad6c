"""The small models and run settings the tests share, as CLI overrides (no torch import).

The lists compose, later overrides winning: a test takes a model, adds ``CPU_FP32`` and
``QUIET`` and then only what it checks, e.g. ``[*GQA32, *QUIET, "--train.max_steps=4"]``.
``model()`` and ``moe()`` spell a shape; the named lists are the shapes several tests reuse.
"""

from __future__ import annotations


def model(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None = None,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> list[str]:
    """The overrides of a model shape (fields left None keep the profile's value)."""
    out = [f"--model.dim={dim}", f"--model.n_layers={n_layers}", f"--model.n_heads={n_heads}"]
    if n_kv_heads is not None:
        out.append(f"--model.n_kv_heads={n_kv_heads}")
    if vocab_size is not None:
        out.append(f"--model.vocab_size={vocab_size}")
    if max_seq_len is not None:
        out.append(f"--model.max_seq_len={max_seq_len}")
    return out


def moe(*, expert_hidden_dim: int = 32, z_loss_weight: float | None = 0.001) -> list[str]:
    """Four routed experts (top 2) and one shared: balancing-bias updates, an aux loss and a z-loss."""
    out = [
        "--model.moe.num_experts=4",
        "--model.moe.top_k=2",
        f"--model.moe.expert_hidden_dim={expert_hidden_dim}",
        "--model.moe.num_shared_experts=1",
        "--model.moe.bias_update_rate=0.01",
        "--model.moe.aux_loss_weight=0.01",
    ]
    if z_loss_weight is not None:
        out.append(f"--model.moe.z_loss_weight={z_loss_weight}")
    return out


CPU_FP32 = ["--train.device=cpu", "--train.mixed_precision=fp32"]
# One intra-op thread per process: on a shared 2-core machine, two threads per process make these
# tiny steps many times slower (they spin against each other and against the other ranks).
ONE_THREAD = ["--train.num_threads=1"]
# Every step logged, no progress bar, no evaluation, one thread (saves are each test's own choice).
QUIET = ["--eval.interval=0", "--metrics.log_interval=1", "--metrics.progress_bar=off", *ONE_THREAD]

# 32 wide, 2 blocks, 4 query and 2 KV heads (GQA): the tests' default tiny model.
GQA32 = model(32, 2, 4, 2)
# ... over a 64-token vocabulary, 16-token sequences, fp32 on the CPU.
TINY_MODEL = [*model(32, 2, 4, 2, vocab_size=64, max_seq_len=32), "--train.seq_len=16", *CPU_FP32]
# 64 wide, 4 blocks: small enough for 2 CPU cores, big enough for every parallel split
# (2 heads per TP rank, 2 blocks per pipeline stage, 1 per virtual stage), the byte vocabulary.
PARITY_MODEL = model(64, 4, 4, 2, vocab_size=320, max_seq_len=64)
