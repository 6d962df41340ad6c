"""The eager CPU RMSNorm and RoPE (engine.model.eager_cpu) and fused block input sides (engine.model.eager_fused)
against the plain formulations.

Forwards of RMSNorm and RoPE must be bitwise the plain ones (HF export compares logits);
the fused projections, GELU and every gradient may differ by float rounding only. What they save for the
backward is checked by the planner's formula test (tests/unit/test_plan_activations.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kforge_cli.engine.model import Transformer, eager_cpu, eager_fused
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


def _plain_norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return x if w is None else F.rms_norm(x, (x.shape[-1],), w, 1e-5)


@pytest.mark.parametrize("normed", [True, False], ids=["rmsnorm", "no-norm"])
def test_linear_gelu_is_norm_linear_and_the_native_gelu_up_to_rounding(normed: bool) -> None:
    """Wide inputs reach GELU's tails (sigmoid saturates, x = 0 exactly, +-60)."""
    g = torch.Generator().manual_seed(0)
    x = 2 * torch.randn(3, 7, 16, generator=g)
    x[0, 0] = 0.0  # rows of zeros: GELU(0) and its derivative 1/2 exactly
    w1 = 4 * torch.randn(48, 16, generator=g)
    w1[:3] = torch.tensor([[-60.0], [12.0], [60.0]]) / 4  # hidden units far into both tails
    nw = torch.randn(16, generator=g) if normed else None
    leaves = [x.requires_grad_(), w1.requires_grad_()] + ([nw.requires_grad_()] if nw is not None else [])

    def ours(x: torch.Tensor, w1: torch.Tensor, *nw: torch.Tensor) -> torch.Tensor:
        return eager_fused.linear_gelu(x, nw[0] if nw else None, 1e-5, w1)

    def plain(x: torch.Tensor, w1: torch.Tensor, *nw: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(_plain_norm(x, nw[0] if nw else None), w1), approximate="tanh")

    out, grads = _grads(ours, *leaves)
    ref, ref_grads = _grads(plain, *leaves)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        assert torch.isfinite(got).all()
    with torch.no_grad():  # no derivative computed, same output
        torch.testing.assert_close(ours(*leaves), out, rtol=0, atol=0)


def _unpair(x: torch.Tensor) -> torch.Tensor:
    """Each head's dimensions from qkv_rope's pair order (0, h, 1, h + 1, ...) back to 0, 1, ..., 2h - 1."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@pytest.mark.parametrize("normed", [True, False], ids=["rmsnorm", "no-norm"])
@pytest.mark.parametrize("per_token", [False, True])
def test_qkv_rope_is_norm_three_projections_and_rotate_half(normed: bool, per_token: bool) -> None:
    """Grouped-query shapes (4 query heads, 2 key/value heads): q, k, v and every gradient."""
    g = torch.Generator().manual_seed(0)
    hd, d = 8, 24
    x = torch.randn(2, 16, d, generator=g, requires_grad=True)
    ws = [torch.randn(n * hd, d, generator=g, requires_grad=True) for n in (4, 2, 2)]
    nw = torch.randn(d, generator=g, requires_grad=True) if normed else None
    cos, sin = rope_tables(hd, 32, 10_000.0)
    cos, sin = cos[:16], sin[:16]
    if per_token:
        pos = torch.randint(0, 32, (2, 16), generator=g)
        cos, sin = rope_tables(hd, 32, 10_000.0)
        cos, sin = cos[pos], sin[pos]
    leaves = [x, *ws] + ([nw] if nw is not None else [])

    def ours(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, *nw: torch.Tensor) -> torch.Tensor:
        q, k, v = eager_fused.qkv_rope(x, nw[0] if nw else None, 1e-5, (wq, wk, wv), cos, sin, hd)
        assert q.shape == (2, 16, 4, hd) and k.shape == v.shape == (2, 16, 2, hd)
        return torch.cat((_unpair(q), _unpair(k), v), dim=2)

    def plain(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, *nw: torch.Tensor) -> torch.Tensor:
        h = _plain_norm(x, nw[0] if nw else None)
        q, k, v = (F.linear(h, w).unflatten(-1, (-1, hd)) for w in (wq, wk, wv))
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return torch.cat((q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v), dim=2)

    out, grads = _grads(ours, *leaves)
    ref, ref_grads = _grads(plain, *leaves)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_qkv_rope_scores_are_rotate_halfs_and_other_tables_are_not_paired() -> None:
    """Attention's scores q . k from the pair-ordered q and k equal the plain layout's; tables whose
    halves differ (not RoPE's) are refused by ``paired_rope``, so the block keeps them unfused."""
    g = torch.Generator().manual_seed(0)
    x, wq, wk = torch.randn(1, 6, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    cos, sin = rope_tables(8, 6, 10_000.0)
    q, k, _ = eager_fused.qkv_rope(x, None, 0.0, (wq, wk, torch.randn(8, 8, generator=g)), cos, sin, 8)
    plain = [(x @ w.t()).unflatten(-1, (1, 8)) for w in (wq, wk)]
    pq, pk = (t * cos.unsqueeze(-2) + rotate_half(t) * sin.unsqueeze(-2) for t in plain)
    assert not torch.equal(q, pq)  # the pair order is real
    torch.testing.assert_close(torch.einsum("bqhd,bkhd->bhqk", q, k), torch.einsum("bqhd,bkhd->bhqk", pq, pk))
    assert eager_fused.paired_rope(cos, sin) and not eager_fused.paired_rope(cos, sin * torch.linspace(0.5, 1.5, 8))


def test_qkv_rope_keeps_only_v_of_the_projection_buffer() -> None:
    """v is copied out of the stacked projection's output, so attention saving v does not keep q/k's part
    alive; q and k come from one token-major buffer (so attention's output is token-major too)."""
    x = torch.randn(2, 4, 8)
    ws = tuple(torch.randn(8, 8) for _ in range(3))
    cos, sin = rope_tables(4, 4, 10_000.0)
    q, k, v = eager_fused.qkv_rope(x, None, 0.0, ws, cos, sin, 4)  # type: ignore[arg-type]
    assert v.untyped_storage().nbytes() == v.numel() * 4
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # one rotated buffer
    assert v.is_contiguous() and torch.cat((q, k), 2).stride() == q.stride()  # [B, T, 2 + 2 heads, hd] underneath


def test_only_plain_cpu_tensors_outside_compile_take_the_eager_path() -> None:
    t = torch.zeros(2)
    assert eager_cpu.eager_cpu(t, torch.nn.Parameter(torch.ones(2)))
    assert not eager_cpu.eager_cpu(t, torch.zeros(2, device="meta"))

    class Sub(torch.Tensor):
        pass

    assert not eager_cpu.eager_cpu(t.as_subclass(Sub))  # DTensor, AsyncCollectiveTensor, float8 wrappers


@pytest.mark.parametrize(
    ("extra", "fused"),
    [({}, (2, 0)), ({"activation": "gelu"}, (2, 2)), ({"activation": "gelu", "qk_norm": True}, (0, 2))],
    ids=["swiglu", "gelu", "gelu-qknorm"],
)
def test_model_on_the_eager_path_equals_the_plain_formulations(
    extra: dict[str, object], fused: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole Transformer, eager CPU kernels on and off: same logits and grads up to float rounding.

    ``fused``: how many blocks' attention and MLP input sides run fused (QK-norm sits between
    the projections and RoPE, so it keeps them apart; SwiGLU's MLP is not fused)."""
    cfg = ModelSettings(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, **extra)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    calls = {"qkv_rope": 0, "linear_gelu": 0}
    for name in calls:
        real = getattr(eager_fused, name)

        def counted(*args: object, _real: object = real, _name: str = name) -> object:
            calls[_name] += 1
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(eager_fused, name, counted)
    runs = []
    for on in (True, False):
        if not on:
            assert (calls["qkv_rope"], calls["linear_gelu"]) == fused
            monkeypatch.setattr(eager_cpu, "eager_cpu", lambda *t: False)
        model.zero_grad()
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert (calls["qkv_rope"], calls["linear_gelu"]) == fused  # the plain run took none
    (fast, fast_grads), (plain, plain_grads) = runs
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    assert fast_grads.keys() == plain_grads.keys()
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
