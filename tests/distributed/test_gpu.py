"""CUDA/NCCL paths (gpu marker): float8 + compile on one GPU, and on >= 2 GPUs the FSDP2
float8 all-gather and torch.compile with tensor parallelism on NCCL; compiled bf16 MoE blocks
(grouped GEMM, one graph per block) with and without float8 on one GPU.

Skipped without CUDA; run on a GPU machine with `pytest -m gpu tests/distributed/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import assert_close_losses, completed, launch, reference

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]

# Dims that are multiples of 16 (float8 GEMMs) and big enough for tensor cores to matter.
GPU = [
    "--train.device=cuda",
    "--model.dim=256",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.vocab_size=512",
    "--train.seq_len=64",
    "--model.max_seq_len=64",
]
BF16 = [*GPU, "--train.mixed_precision=bf16"]


def _gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {torch.cuda.device_count()}")


def test_float8_with_compile_trains_close_to_bf16_on_one_gpu() -> None:
    pytest.importorskip("torchao")
    bf16 = reference((*BF16,))["losses"]
    fp8 = reference((*BF16, "--train.float8=true", "--train.compile_model=true"))["losses"]
    assert_close_losses(fp8, bf16, 2e-2, "float8+compile vs bf16 (cuda)")
    assert fp8[-1] < fp8[0]


MOE_GPU = [
    *BF16,
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.num_shared_experts=1",
    "--model.moe.bias_update_rate=0.001",
]


# One cold compile per test (the eager reference is cached and shared): each fits the per-test limit
# of bench/gpu/acceptance.py (TEST_LIMIT_S, 120 s), where one test with two cold compiles did not.


def test_compiled_moe_keeps_grouped_gemm_in_one_graph_on_one_gpu() -> None:
    """bf16 on CUDA: the traced grouped GEMM (bf16 only) stays; no graph break; close to eager."""
    from torch._dynamo.utils import counters

    eager = reference((*MOE_GPU,))["losses"]
    counters.clear()
    compiled = reference((*MOE_GPU, "--train.compile_model=true"))["losses"]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_close_losses(compiled, eager, 2e-2, "compiled MoE vs eager MoE (cuda bf16)")


def test_float8_compiled_moe_trains_close_to_bf16_on_one_gpu() -> None:
    """float8 on attention and the shared experts only (the routed experts' grouped GEMM stays bf16)."""
    pytest.importorskip("torchao")
    eager = reference((*MOE_GPU,))["losses"]
    fp8 = reference((*MOE_GPU, "--train.float8=true", "--train.compile_model=true"))["losses"]
    assert_close_losses(fp8, eager, 2e-2, "float8+compile MoE vs bf16 MoE (cuda)")


def test_fsdp_float8_all_gather_on_nccl(tmp_path_factory: pytest.TempPathFactory) -> None:
    _gpus(2)
    pytest.importorskip("torchao")
    res = launch(2, {"bf16": BF16, "fp8": [*BF16, "--train.float8=true"]}, tmp_path_factory.mktemp("fp8"))
    bf16 = completed(res["bf16"], "bf16")[0]["losses"]
    for r in completed(res["fp8"], "fp8"):
        assert_close_losses(r["losses"], bf16, 2e-2, "FSDP2 float8 all-gather vs bf16 (nccl)")


def test_compile_with_tensor_parallel_matches_eager_on_cuda(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Compile + TP equals eager TP on NCCL too (fp32; gloo: test_parallel_parity tp_compile)."""
    _gpus(2)
    fp32 = [*GPU, "--train.mixed_precision=fp32", "--distributed.tp=2"]
    res = launch(2, {"eager": fp32, "compiled": [*fp32, "--train.compile_model=true"]}, tmp_path_factory.mktemp("ctp"))
    eager = completed(res["eager"], "eager")[0]["losses"]
    for r in completed(res["compiled"], "compiled"):
        assert_close_losses(r["losses"], eager, 1e-4, "compile+TP vs eager TP (cuda)")
