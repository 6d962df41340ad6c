"""The activation formula (engine.plan.activations) against what autograd really saves.

The saved-tensor hooks see every tensor a block keeps for its backward; their storages,
minus parameters and buffers (RoPE tables), must add up to ``block_full_bytes`` exactly.
The full peak (saved + backward transients) is checked against measured peaks in
tests/distributed/test_plan_measured.py.
"""

from __future__ import annotations

import pytest
import torch

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.plan.activations import (
    ActivationInputs,
    block_full_bytes,
    block_input_bytes,
    block_saved_bytes,
    bubble_fraction,
    estimate_activations,
    pipeline_in_flight,
)
from kforge_cli.settings.training import ModelSettings

B, T = 2, 64


def _inputs(cfg: ModelSettings, **kw: object) -> ActivationInputs:
    base: dict[str, object] = dict(
        micro_batch=B,
        seq_len=T,
        dim=cfg.dim,
        q_dim=cfg.n_heads * cfg.head_dim,
        kv_dim=cfg.kv_heads * cfg.head_dim,
        n_heads=cfg.n_heads,
        ffn=cfg.resolved_ffn_hidden_dim,
        gated=cfg.activation == "swiglu",
        vocab=cfg.vocab_size,
        norm=cfg.norm,
        qk_norm=cfg.qk_norm,
        tp=1,
        sequence_parallel=False,
        loss_parallel=False,
        compute_bytes=4,
        autocast=False,
        cuda=False,
        block_weight_copy_bytes=0,
        loss_chunk=0,
        document_mask=False,
        ac_mode="none",
    )
    base.update(kw)
    return ActivationInputs(**base)  # type: ignore[arg-type]


def _saved_by_one_block(cfg: ModelSettings) -> int:
    """Bytes of the distinct storages block 0 saves for backward, parameters and buffers excluded."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(B, T, cfg.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, model.rope_cos[:T], model.rope_sin[:T])
    return sum(storages.values())


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"activation": "gelu"},
        {"qk_norm": True},
        {"n_kv_heads": 4},
        {"dim": 96, "n_heads": 3, "n_kv_heads": 1, "ffn_hidden_dim": 200},
    ],
    ids=["swiglu-gqa", "gelu", "qk_norm", "mha", "odd-sizes"],
)
def test_block_formula_equals_saved_tensors_on_cpu(extra: dict) -> None:
    shape = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "max_seq_len": T}
    cfg = ModelSettings(**{**shape, **extra})
    assert block_full_bytes(_inputs(cfg)) == _saved_by_one_block(cfg)


def test_block_formula_known_value() -> None:
    """Hand count, fp32 on CUDA, N = 2*64 tokens, D = 64, kv = 32, F = 192, 4 heads:
    norms 2 x (4ND + 4N) + linear inputs 2 x 4ND + q/out 2 x 4ND + k/v 2 x 4N*kv + lse 4N*4 + MLP 4 x 4NF.
    On CPU torch's composite rms_norm also keeps the normalised input: another 4ND per norm."""
    cfg = ModelSettings(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=T)
    n = B * T
    want = 2 * (4 * n * 64 + 4 * n) + 2 * 4 * n * 64 + 2 * 4 * n * 64 + 2 * 4 * n * 32 + 4 * n * 4 + 4 * 4 * n * 192
    assert block_full_bytes(_inputs(cfg, cuda=True)) == want
    assert block_full_bytes(_inputs(cfg)) == want + 2 * 4 * n * 64


@pytest.mark.parametrize("cuda", [True, False])
def test_tensor_parallel_divides_what_is_split(cuda: bool) -> None:
    cfg = ModelSettings(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=T)
    one, sp = _inputs(cfg, cuda=cuda), _inputs(cfg, tp=2, sequence_parallel=True, cuda=cuda)
    n, d = B * T, 64
    # Norm inputs are split over the sequence, linear inputs are all-gathered (full), the rest is split by heads/F.
    split = 2 * (4 * n * d + 4 * n) + 2 * 4 * n * 64 + 2 * 4 * n * 32 + 4 * n * 4 + 4 * 4 * n * 192
    # On CPU torch's composite rms_norm also keeps the normalised input (split over the sequence too).
    composite = 0 if cuda else 2 * 4 * n * d
    assert block_full_bytes(one) - block_full_bytes(sp) == (split + composite) // 2
    assert block_input_bytes(sp) == 4 * (n // 2) * d


def test_selective_block_checkpoints_every_kth_global_index() -> None:
    cfg = ModelSettings(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=T)
    a = _inputs(cfg, ac_mode="selective_block", ac_every_n_blocks=2)
    assert [block_saved_bytes(a, i) == block_input_bytes(a) for i in range(4)] == [True, False, True, False]


def test_full_ac_peak_is_inputs_plus_one_recomputed_block() -> None:
    cfg = ModelSettings(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=T)
    full = estimate_activations(_inputs(cfg, ac_mode="full"), [0, 1, 2, 3], has_head=False)
    none = estimate_activations(_inputs(cfg), [0, 1, 2, 3], has_head=False)
    a = _inputs(cfg)
    assert full.saved_per_microbatch == 4 * block_input_bytes(a)
    # Both peak in the last block's backward: 4 saved sets + that block's recompute (full AC) or nothing more.
    assert full.peak - none.peak == 3 * block_input_bytes(a) - 3 * block_full_bytes(a)


def test_pipeline_in_flight_and_bubble() -> None:
    assert [pipeline_in_flight("1f1b", 4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert pipeline_in_flight("1f1b", 4, 0, 1, 2) == 2  # never more than the micro-batches of a step
    assert pipeline_in_flight("gpipe", 4, 3, 1, 8) == 8
    # interleaved, v = 2 stages per rank, pp = 2: rank 0 runs (2-1)*2 + 2*(2-1-0) + 1 = 5 stage-forwards first
    assert pipeline_in_flight("interleaved_1f1b", 2, 0, 2, 8) == 2.5
    assert pipeline_in_flight("1f1b", 1, 0, 1, 8) == 1
    assert bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 2, 16) == pytest.approx(3 / 35)
    assert bubble_fraction(1, 1, 1) == 0.0
