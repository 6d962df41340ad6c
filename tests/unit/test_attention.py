"""Attention backends: FlexAttention's document block mask equals dense-mask SDPA; documents stay apart.

FlexAttention has no CPU backward in torch 2.13, so the flex checks here run forward only
(eager flex, under no_grad); forward and backward on CUDA are in tests/distributed/test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kforge_cli.engine.data import build_data
from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model.attention_mask import (
    attend,
    build_attention_mask,
    document_causal_mask,
    resolve_backend,
)
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.rules import config_issues
from kforge_cli.settings.training import ModelSettings

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 64
DOCS = torch.tensor([[0] * 7 + [1] * 13 + [2] * 12, [0] * 20 + [1] * 12])  # [2, 32], docs of unequal length


def tiny(attention: str, **kw: object) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelSettings(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64, **kw)  # type: ignore[arg-type]
    return Transformer(cfg.model_copy(update={"attention": attention})).eval()


def positions_of(doc_ids: torch.Tensor) -> torch.Tensor:
    """RoPE positions restarting at 0 at each document start."""
    out = torch.zeros_like(doc_ids)
    for b in range(doc_ids.shape[0]):
        for d in doc_ids[b].unique():
            idx = (doc_ids[b] == d).nonzero().flatten()
            out[b, idx] = torch.arange(idx.numel())
    return out


def test_auto_is_flex_only_on_cuda_with_documents() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, documents=True) == "sdpa"
    assert resolve_backend("auto", cuda, documents=True) == "flex"
    assert resolve_backend("auto", cuda, documents=False) == "sdpa"
    assert resolve_backend("flex", cpu, documents=False) == "flex"
    mask = build_attention_mask("auto", (2, 32), cpu)
    assert mask.kind == "causal"  # plain causal keeps SDPA's is_causal (flash on GPU)
    assert build_attention_mask("auto", (2, 32), cpu, DOCS).kind == "dense"
    assert build_attention_mask("flex", (2, 32), cpu, DOCS).kind == "flex"


def test_flex_on_cpu_is_refused_for_training_naming_the_field() -> None:
    settings = JobSettings(model={"attention": "flex"}, train={"device": "cpu"})  # type: ignore[arg-type]
    issues = [i for i in config_issues(settings) if i.path == "model.attention"]
    assert len(issues) == 1 and "no backward on CPU" in issues[0].message
    assert not config_issues(JobSettings(model={"attention": "auto"}, train={"device": "cpu"}))  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_block_mask_forward_equals_dense_mask_sdpa(kv_heads: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 32, 8, generator=g) for _ in range(2))
    dense = build_attention_mask("sdpa", (2, 32), torch.device("cpu"), DOCS)
    flex = build_attention_mask("flex", (2, 32), torch.device("cpu"), DOCS)
    with torch.no_grad():
        ref = attend(q, k, v, dense)
        out = attend(q, k, v, flex)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # The block mask is the dense one: both differ from plain causal attention.
    assert (attend(q, k, v, None) - ref).abs().max() > 1e-2
    torch.testing.assert_close(dense.dense, document_causal_mask(DOCS))


def test_flex_model_forward_equals_sdpa_model() -> None:
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    pos = positions_of(DOCS)
    with torch.no_grad():
        ref = tiny("sdpa")(x, doc_ids=DOCS, positions=pos)
        out = tiny("flex")(x, doc_ids=DOCS, positions=pos)
        causal_ref, causal_flex = tiny("sdpa")(x), tiny("flex")(x)  # flex without documents: causal block mask
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(causal_flex, causal_ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_no_token_attends_across_a_document_boundary(attention: str) -> None:
    """Perturbing document 1 leaves documents 0 and 2 untouched; plain causal attention leaks."""
    model = tiny(attention)
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[0, 7:20] = (y[0, 7:20] + 5) % VOCAB  # row 0's document 1
    pos = positions_of(DOCS)
    with torch.no_grad():
        a, b = model(x, doc_ids=DOCS, positions=pos), model(y, doc_ids=DOCS, positions=pos)
        leak_a, leak_b = model(x, positions=pos), model(y, positions=pos)
    torch.testing.assert_close(a[0, 20:], b[0, 20:], rtol=0, atol=1e-6)  # document 2 unchanged
    torch.testing.assert_close(a[0, :7], b[0, :7], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert (a[0, 7:20] - b[0, 7:20]).abs().max() > 1e-3  # the perturbed document itself did change
    assert (leak_a[0, 20:] - leak_b[0, 20:]).abs().max() > 1e-3  # causal-only attention lets it through


def test_document_masked_batches_restart_rope_positions_at_every_document() -> None:
    settings = JobSettings(
        model=ModelSettings(dim=32, n_layers=1, n_heads=4, vocab_size=512),
        train={"seq_len": 256, "batch_size": 2},  # type: ignore[arg-type]
        data={"document_masking": True},  # type: ignore[arg-type]
    )
    bundle = build_data(settings, dp_rank=0, dp_size=1)
    batch = next(iter(bundle.train))
    ids, pos, docs = batch["input_ids"].numpy(), batch["positions"].numpy(), batch["doc_ids"].numpy()
    eos = bundle.tokenizer.eos_id
    assert (ids == eos).sum() >= 2  # several documents per row
    starts = np.zeros_like(ids, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eos
    assert (pos[starts] == 0).all()
    assert (pos[:, 1:][~starts[:, 1:]] == pos[:, :-1][~starts[:, 1:]] + 1).all()
    assert ((docs[:, 1:] != docs[:, :-1]) == starts[:, 1:]).all()


@pytest.mark.gpu
def test_flex_forward_and_backward_equal_dense_mask_sdpa_on_cuda() -> None:
    """Compiled FlexAttention (the training kernel) against dense-mask SDPA, values and gradients."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    docs = torch.cat([torch.zeros(300), torch.ones(500), torch.full((224,), 2)]).long().to(dev)[None].repeat(2, 1)
    shape = (2, 4, 1024, 64)
    q = torch.randn(*shape, device=dev, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 1024, 64, device=dev, generator=g, requires_grad=True) for _ in range(2))
    outs, grads = [], []
    for backend in ("sdpa", "flex"):
        mask = build_attention_mask(backend, (2, 1024), dev, docs)  # type: ignore[arg-type]
        assert mask.kind == ("dense" if backend == "sdpa" else "flex")
        out = attend(q, k, v, mask)
        (out * torch.linspace(-1, 1, 64, device=dev)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])  # type: ignore[union-attr]
        for t in (q, k, v):
            t.grad = None
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=2e-4)
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    # The next batch's documents: the once-compiled create_block_mask reads the new ids, not the first ones.
    docs = torch.cat([torch.zeros(700), torch.ones(324)]).long().to(dev)[None].repeat(2, 1)
    with torch.no_grad():
        want, got = (attend(q, k, v, build_attention_mask(b, (2, 1024), dev, docs)) for b in ("sdpa", "flex"))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
