"""The eager CPU RMSNorm and RoPE (engine.model.eager_cpu) against the plain formulations.

Forwards of RMSNorm and RoPE must be bitwise the plain ones (HF export compares logits);
every gradient may differ by float rounding only. What they save for the
backward is checked by the planner's formula test (tests/unit/test_plan_activations.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kforge_cli.engine.model import Transformer, eager_cpu
from kforge_cli.engine.model.layers import rope_tables, rotate_half
from kforge_cli.settings.training import ModelSettings


def _grads(fn: object, *inputs: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)  # type: ignore[operator]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]  # type: ignore[misc]


@pytest.mark.parametrize("shape", [(2, 16, 64), (2, 16, 4, 16)], ids=["stream", "qk-norm-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_composite_up_to_rounding(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()

    def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (shape[-1],), w.float(), 1e-5).to(x.dtype)

    ours, (gx, gw) = _grads(lambda x, w: eager_cpu.rms_norm(x, w, 1e-5), x, w)
    theirs, (px, pw) = _grads(plain, x, w)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(gx, px, **tol)
    torch.testing.assert_close(gw, pw, **tol)
    assert gx.dtype == dtype and gw.dtype == dtype


@pytest.mark.parametrize("per_token", [False, True])
def test_rotary_is_rotate_half_exactly_forward_and_transposed_backward(per_token: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 3, 8, generator=g, requires_grad=True)
    cos, sin = rope_tables(8, 32, 10_000.0)
    if per_token:  # [B, T, hd] tables from explicit positions; halves made unequal on purpose (any table works)
        pos = torch.randint(0, 32, (2, 16), generator=g)
        cos, sin = cos[pos], sin[pos] * torch.linspace(0.5, 1.5, 8)
    else:
        cos, sin = cos[:16], sin[:16]

    def plain(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return x * c + rotate_half(x) * s

    ours, (gx,) = _grads(lambda x: eager_cpu.rotary((x,), cos, sin)[0], x)
    theirs, (px,) = _grads(plain, x)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(gx, px, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_rotary_of_queries_and_keys_in_one_call_is_two_plain_calls(per_token: bool) -> None:
    """q and k (grouped-query: fewer key heads) through one call: each bitwise its plain rotation, grads close."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, generator=g, requires_grad=True)
    cos, sin = rope_tables(8, 32, 10_000.0)
    cos, sin = cos[:16], sin[:16]
    if per_token:
        pos = torch.randint(0, 32, (2, 16), generator=g)
        cos, sin = rope_tables(8, 32, 10_000.0)
        cos, sin = cos[pos], sin[pos]

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)

    def ours_fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        rq, rk = eager_cpu.rotary((q, k), cos, sin)
        return torch.cat((rq, rk), dim=2)

    ours, (gq, gk) = _grads(ours_fn, q, k)
    theirs, (pq, pk) = _grads(lambda q, k: torch.cat((plain(q), plain(k)), dim=2), q, k)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(gq, pq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gk, pk, rtol=1e-6, atol=1e-6)


def test_only_plain_cpu_tensors_outside_compile_take_the_eager_path() -> None:
    t = torch.zeros(2)
    assert eager_cpu.eager_cpu(t, torch.nn.Parameter(torch.ones(2)))
    assert not eager_cpu.eager_cpu(t, torch.zeros(2, device="meta"))

    class Sub(torch.Tensor):
        pass

    assert not eager_cpu.eager_cpu(t.as_subclass(Sub))  # DTensor, AsyncCollectiveTensor, float8 wrappers


@pytest.mark.parametrize(
    "extra",
    [{}, {"activation": "gelu"}, {"activation": "gelu", "qk_norm": True}],
    ids=["swiglu", "gelu", "gelu-qknorm"],
)
def test_model_on_the_eager_path_equals_the_plain_formulations(
    extra: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole Transformer, eager CPU kernels on and off: same logits and grads up to float rounding."""
    cfg = ModelSettings(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, **extra)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(eager_cpu, "eager_cpu", lambda *t: False)
        model.zero_grad()
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (fast, fast_grads), (plain, plain_grads) = runs
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    assert fast_grads.keys() == plain_grads.keys()
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
