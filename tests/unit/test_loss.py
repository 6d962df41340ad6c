"""Cross-entropy sum, z-loss, the chunked path (values and gradients) and LossFn."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kforge_cli.engine.train.loss import (
    IGNORE_INDEX,
    LossFn,
    build_loss_fn,
    chunked_cross_entropy_sum,
    count_valid_tokens,
    cross_entropy_sum,
)
from kforge_cli.settings import JobSettings


def test_cross_entropy_sum_matches_hand_computation() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]])
    labels = torch.tensor([0, 1])
    lse0 = math.log(math.exp(2.0) + 2.0)
    lse1 = math.log(1.0 + math.e + math.exp(3.0))
    expected = (lse0 - 2.0) + (lse1 - 1.0)
    assert cross_entropy_sum(logits, labels).item() == pytest.approx(expected, abs=1e-6)


def test_ignore_index_positions_are_excluded() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [5.0, -5.0, 0.0]])
    labels = torch.tensor([0, IGNORE_INDEX, IGNORE_INDEX])
    expected = math.log(math.exp(2.0) + 2.0) - 2.0
    assert cross_entropy_sum(logits, labels).item() == pytest.approx(expected, abs=1e-6)
    assert count_valid_tokens(labels) == 1
    assert cross_entropy_sum(logits, torch.full((3,), IGNORE_INDEX)).item() == 0.0


def test_is_a_sum_equal_to_torch_mean_times_count() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 1] = IGNORE_INDEX
    labels[1, 4] = IGNORE_INDEX
    mean = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    assert cross_entropy_sum(logits, labels).item() == pytest.approx(mean.item() * 8, rel=1e-6)


def test_z_loss_of_zero_logits_is_log_v_squared_per_token() -> None:
    vocab, tokens = 7, 4
    logits = torch.zeros(tokens, vocab)
    labels = torch.tensor([0, 3, IGNORE_INDEX, 6])
    ce_only = cross_entropy_sum(logits, labels)
    with_z = cross_entropy_sum(logits, labels, z_loss_weight=0.5)
    assert ce_only.item() == pytest.approx(3 * math.log(vocab), abs=1e-6)
    assert (with_z - ce_only).item() == pytest.approx(0.5 * 3 * math.log(vocab) ** 2, abs=1e-5)


def test_bf16_logits_are_computed_in_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen).bfloat16()
    labels = torch.randint(0, 50, (6,), generator=gen)
    out = cross_entropy_sum(logits, labels, z_loss_weight=1e-2)
    assert out.dtype == torch.float32
    reference = cross_entropy_sum(logits.float(), labels, z_loss_weight=1e-2)
    assert out.item() == pytest.approx(reference.item(), abs=1e-6)


def _inputs(seed: int, batch: int = 2, seq: int = 7, dim: int = 8, vocab: int = 13):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, 0] = IGNORE_INDEX
    labels[1, 3] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 14, 100])  # 14 = B*T divides; 5 does not; 100 > B*T
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-3])
def test_chunked_equals_plain_in_value_and_gradients(chunk_size: int, z_loss_weight: float) -> None:
    hidden, weight, labels = _inputs(seed=chunk_size)
    h_plain, w_plain = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_chunk, w_chunk = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    plain = cross_entropy_sum(h_plain @ w_plain.t(), labels, z_loss_weight)
    plain.backward()
    chunked = chunked_cross_entropy_sum(h_chunk, w_chunk, labels, chunk_size, z_loss_weight)
    chunked.backward()

    # cross_entropy_sum computes in fp32, so agreement is to fp32 precision.
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert h_chunk.grad is not None and h_plain.grad is not None
    assert w_chunk.grad is not None and w_plain.grad is not None
    torch.testing.assert_close(h_chunk.grad, h_plain.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_chunk.grad, w_plain.grad, rtol=1e-5, atol=1e-6)


def _saved_shapes(fn) -> list[tuple[int, ...]]:
    """Shapes of every tensor the autograd graph saves for the backward while running ``fn``."""
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_chunked_keeps_no_logits_alive_for_backward() -> None:
    """With checkpointing the graph saves only each chunk's inputs, never a [tokens, V] logits tensor."""
    vocab, dim = 97, 8
    hidden, weight, labels = _inputs(seed=3, dim=dim, vocab=vocab)
    hidden.requires_grad_()
    weight.requires_grad_()

    def logits_like(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        return [s for s in shapes if vocab in s and s not in ((vocab, dim), (dim, vocab))]

    plain = _saved_shapes(lambda: cross_entropy_sum(hidden @ weight.t(), labels))
    assert logits_like(plain), "the plain path should save logits (sanity check of this test)"
    chunked = _saved_shapes(lambda: chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=4))
    assert (4, dim) in chunked
    assert logits_like(chunked) == []


def test_loss_fn_from_settings() -> None:
    plain = build_loss_fn(JobSettings(train={"loss_chunk_size": 0, "z_loss_weight": 1e-4}))
    chunked = build_loss_fn(JobSettings(train={"loss_chunk_size": 3, "z_loss_weight": 1e-4}))
    assert not plain.chunked and chunked.chunked
    assert chunked.z_loss_weight == 1e-4
    hidden, weight, labels = _inputs(seed=5)
    expected = cross_entropy_sum(hidden @ weight.t(), labels, 1e-4).item()
    assert plain(hidden, weight, labels).item() == pytest.approx(expected, rel=1e-6)
    assert chunked(hidden, weight, labels).item() == pytest.approx(expected, rel=1e-6)
    assert chunked.from_logits(hidden @ weight.t(), labels).item() == pytest.approx(expected, rel=1e-6)


def test_loss_fn_rejects_negative_chunk_size() -> None:
    with pytest.raises(ValueError):
        LossFn(chunk_size=-1)
