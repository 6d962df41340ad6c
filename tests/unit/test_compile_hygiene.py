"""Small build/validation facts of the GPU paths that CPU can check: RoPE tables stay fp32
with a bf16 master copy, float8 without compile is warned about, the gradient norm is fp32."""

from __future__ import annotations

import torch

from kforge_cli.engine.parallel import build_parallel_model, total_grad_norm
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.settings import load_settings
from tests.helpers import tiny

TINY = [*tiny.model(64, 1, 4, vocab_size=128), "--train.device=cpu"]


def test_rope_tables_stay_fp32_with_bf16_master_weights_on_one_process() -> None:
    s = load_settings(overrides=[*TINY, "--train.master_dtype=bf16", "--train.mixed_precision=bf16"]).settings
    model, _ = build_parallel_model(s, init_runtime(s))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    s32 = load_settings(overrides=TINY).settings
    ref, _ = build_parallel_model(s32, init_runtime(s32))
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)  # not rounded
    logits = model(torch.randint(0, 128, (2, 16)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_float8_without_compile_is_warned_about() -> None:
    warned = [w.path for w in load_settings(overrides=["--train.float8=true"]).warnings]
    assert "train.float8" in warned
    both = ["--train.float8=true", "--train.compile_model=true"]
    assert "train.float8" not in [w.path for w in load_settings(overrides=both).warnings]


def test_gradient_norm_is_accumulated_in_fp32() -> None:
    """bf16 gradients whose squares underflow/round in bf16: the norm is still exact in fp32."""
    grads = [torch.full((4096,), 1e-3, dtype=torch.bfloat16) for _ in range(8)]
    params = [torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16)) for _ in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    norm = total_grad_norm(params)
    want = torch.cat([g.double() for g in grads]).norm().float()
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
