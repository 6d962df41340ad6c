"""The Transformer: shapes, parameter count, init, causality, GQA, document masking, tied head, FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model import count_params, flops_per_token, non_embedding_params
from kforge_cli.engine.model.layers import apply_rotary, rope_tables
from kforge_cli.settings.training import ModelSettings

VOCAB = 64


def tiny(**overrides: object) -> ModelSettings:
    base: dict[str, object] = {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB, "max_seq_len": 64}
    base.update(overrides)
    return ModelSettings(**base)  # type: ignore[arg-type]


def build(cfg: ModelSettings, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def tokens(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), generator=g)


CONFIGS = {
    "swiglu_gqa": tiny(n_kv_heads=2),
    "gelu_layernorm": tiny(activation="gelu", norm="layernorm"),
    "qk_norm": tiny(qk_norm=True, n_kv_heads=1),
    "tied": tiny(tie_embeddings=True),
    "qk_layernorm_tied_gelu": tiny(qk_norm=True, norm="layernorm", activation="gelu", tie_embeddings=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_output_shape_and_param_count_match_config(name: str) -> None:
    cfg = CONFIGS[name]
    model = build(cfg)
    logits = model(tokens(2, 10))
    assert logits.shape == (2, 10, VOCAB)
    assert torch.isfinite(logits).all()
    expected = cfg.param_count()
    assert count_params(model) == expected
    # N of the FLOP formula = everything but the embedding table, plus the head once when tied.
    head_once = cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0
    assert non_embedding_params(cfg) == expected - cfg.vocab_size * cfg.dim + head_once


def test_module_names_are_the_checkpoint_contract() -> None:
    model = build(tiny(qk_norm=True, n_kv_heads=2))
    names = set(model.state_dict())
    for expected in (
        "tok_embeddings.weight",
        "layers.1.attention_norm.weight",
        "layers.1.attention.wq.weight",
        "layers.1.attention.wk.weight",
        "layers.1.attention.wv.weight",
        "layers.1.attention.wo.weight",
        "layers.1.attention.q_norm.weight",
        "layers.1.attention.k_norm.weight",
        "layers.1.ffn_norm.weight",
        "layers.1.feed_forward.w1.weight",
        "layers.1.feed_forward.w2.weight",
        "layers.1.feed_forward.w3.weight",
        "norm.weight",
        "output.weight",
    ):
        assert expected in names
    assert not any("bias" in n or "rope" in n for n in names)  # no biases; RoPE tables are not persisted
    assert model.layers["0"].attention.wk.weight.shape == (16, 32)


def test_meta_build_then_init_equals_direct_cpu_build() -> None:
    cfg = tiny(n_kv_heads=2, qk_norm=True)
    direct = build(cfg, seed=123)
    torch.manual_seed(123)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    assert lazy.layers["0"].attention.wq.weight.is_meta
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    for (name, a), b in zip(direct.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        assert torch.isfinite(b).all(), name
    assert torch.equal(lazy.rope_cos, direct.rope_cos) and torch.equal(lazy.rope_sin, direct.rope_sin)
    expected_cos, _ = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    assert lazy.rope_cos.dtype == torch.float32 and torch.equal(lazy.rope_cos, expected_cos)
    x = tokens(1, 8)
    torch.testing.assert_close(lazy.eval()(x), direct(x), rtol=0, atol=0)
    # A different seed gives different weights (the test above would otherwise be vacuous).
    assert not torch.equal(build(cfg, seed=124).tok_embeddings.weight, direct.tok_embeddings.weight)


def test_init_std_of_projections() -> None:
    cfg = tiny(dim=256, n_heads=4, n_layers=4, init_std=0.02)
    model = build(cfg)
    block = model.layers["2"]
    residual = 0.02 / math.sqrt(2 * 4)
    # 65536 samples: the std estimate's relative error is ~0.3%, 3% is > 10 sigma.
    assert block.attention.wo.weight.std().item() == pytest.approx(residual, rel=0.03)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual, rel=0.03)
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))


def test_init_weights_tolerates_a_pipeline_stage() -> None:
    cfg = tiny(n_layers=3)
    with torch.device("meta"):
        stage = Transformer(cfg)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights()
    assert list(stage.layers.keys()) == ["1", "2"]
    hidden = torch.randn(2, 6, cfg.dim)
    logits = stage(hidden)
    assert logits.shape == (2, 6, VOCAB) and torch.isfinite(logits).all()
    # A middle stage (no final norm/head) returns hidden states.
    stage.norm = None
    stage.output = None
    assert stage(hidden).shape == (2, 6, cfg.dim)


def test_pipeline_stages_compose_to_the_full_model() -> None:
    cfg = tiny(n_layers=3)
    full = build(cfg)
    first, last = build(cfg), build(cfg)
    del first.layers["2"]
    first.norm, first.output = None, None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    x = tokens(2, 9)
    torch.testing.assert_close(last(first(x)), full(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["swiglu_gqa", "gelu_layernorm", "qk_norm"])
def test_causality(name: str) -> None:
    model = build(CONFIGS[name])
    x = tokens(2, 12)
    t = 5
    y = x.clone()
    y[:, t + 1 :] = (y[:, t + 1 :] + 7) % VOCAB
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-3  # later positions do see the change


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    gqa_cfg = tiny(n_heads=4, n_kv_heads=2, qk_norm=True)
    gqa = build(gqa_cfg)
    mha = build(tiny(n_heads=4, qk_norm=True), seed=5)
    state = dict(gqa.state_dict())
    rep, hd, dim = 2, gqa_cfg.head_dim, gqa_cfg.dim
    for i in range(gqa_cfg.n_layers):
        for proj in ("wk", "wv"):
            key = f"layers.{i}.attention.{proj}.weight"
            heads = state[key].view(gqa_cfg.kv_heads, hd, dim)
            # Query head h uses KV head h // rep.
            state[key] = heads.repeat_interleave(rep, dim=0).reshape(4 * hd, dim)
    mha.load_state_dict(state)
    x = tokens(2, 11)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-5)
    doc_ids = torch.tensor([[0] * 5 + [1] * 6, [0] * 11])
    torch.testing.assert_close(gqa(x, doc_ids=doc_ids), mha(x, doc_ids=doc_ids), rtol=0, atol=1e-5)


def test_document_masking_equals_running_documents_separately() -> None:
    model = build(tiny(n_kv_heads=2))
    lengths = [[4, 7, 3], [9, 5]]
    seqs, doc_ids, positions = [], [], []
    for row in lengths:
        seqs.append(tokens(1, sum(row), seed=len(seqs) + 10)[0])
        doc_ids.append(torch.cat([torch.full((n,), d) for d, n in enumerate(row)]))
        positions.append(torch.cat([torch.arange(n) for n in row]))
    x, docs, pos = torch.stack(seqs), torch.stack(doc_ids), torch.stack(positions)
    packed = model(x, doc_ids=docs, positions=pos)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            alone = model(x[b : b + 1, start : start + n])
            torch.testing.assert_close(packed[b : b + 1, start : start + n], alone, rtol=0, atol=1e-5)
            start += n
    # Without the mask the second document attends to the first, so the logits differ.
    unmasked = model(x, positions=pos)
    assert (unmasked[0, 4:11] - packed[0, 4:11]).abs().max() > 1e-3


def test_rope_uses_the_hf_rotate_half_pairing() -> None:
    # head_dim 4, theta 100: frequencies 1 and 100 ** -0.5 = 0.1; dimension i pairs with i + 2.
    cos, sin = rope_tables(head_dim=4, max_seq_len=8, theta=100.0)
    p = 3
    x = torch.tensor([1.0, 2.0, 0.0, 0.0]).view(1, 1, 1, 4)
    got = apply_rotary(x, cos[p : p + 1], sin[p : p + 1]).flatten()
    expected = torch.tensor([math.cos(3), 2 * math.cos(0.3), math.sin(3), 2 * math.sin(0.3)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # Scores depend only on the relative position: <R(p) q, R(p + 2) k> is the same for every p.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 4, generator=g), torch.randn(1, 1, 1, 4, generator=g)
    scores = [
        (
            apply_rotary(q, cos[p : p + 1], sin[p : p + 1]) * apply_rotary(k, cos[p + 2 : p + 3], sin[p + 2 : p + 3])
        ).sum()
        for p in range(5)
    ]
    torch.testing.assert_close(torch.stack(scores), scores[0].expand(5), rtol=0, atol=1e-5)


def test_default_positions_equal_explicit_arange() -> None:
    model = build(tiny())
    x = tokens(2, 10)
    pos = torch.arange(10).expand(2, 10)
    torch.testing.assert_close(model(x, positions=pos), model(x), rtol=0, atol=1e-6)


def test_tied_embeddings_share_the_head_and_get_gradients() -> None:
    model = build(tiny(tie_embeddings=True))
    assert model.output is None
    assert "output.weight" not in model.state_dict()
    x = tokens(2, 8)
    logits = model(x)
    hidden = model.norm(_hidden_before_norm(model, x))
    torch.testing.assert_close(logits, hidden @ model.tok_embeddings.weight.T, rtol=0, atol=1e-5)
    F.cross_entropy(logits.flatten(0, 1), tokens(2, 8, seed=2).flatten()).backward()
    grad = model.tok_embeddings.weight.grad
    assert grad is not None
    # Every row gets a head gradient, not only the rows of the input tokens.
    unused = sorted(set(range(VOCAB)) - set(x.flatten().tolist()))
    assert grad[unused].abs().sum(dim=1).gt(0).all()


def _hidden_before_norm(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    norm, output = model.norm, model.output
    model.norm = None
    try:
        return model(x)
    finally:
        model.norm, model.output = norm, output


@pytest.mark.parametrize("tied", [False, True])
def test_loss_fn_receives_hidden_and_head_weight(tied: bool) -> None:
    model = build(tiny(tie_embeddings=tied))
    x, labels = tokens(2, 8), tokens(2, 8, seed=3)
    seen: dict[str, torch.Tensor] = {}

    def loss_fn(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen["hidden"], seen["weight"] = hidden, weight
        logits = hidden @ weight.T
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    loss = model(x, labels=labels, loss_fn=loss_fn)
    assert seen["hidden"].shape == (2, 8, 32) and seen["weight"].shape == (VOCAB, 32)
    head = model.tok_embeddings.weight if tied else model.output.weight
    assert seen["weight"] is head
    reference = F.cross_entropy(model(x).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-5)
    assert loss.item() == pytest.approx(math.log(VOCAB), rel=0.05)  # near-uniform at init
    with pytest.raises(ValueError, match="both labels and loss_fn"):
        model(x, labels=labels)


def test_sequence_longer_than_max_seq_len_is_rejected() -> None:
    model = build(tiny(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(tokens(1, 9))


def test_flops_per_token_known_value() -> None:
    cfg = tiny(n_kv_heads=2, ffn_hidden_dim=96)  # dim 32, 4 heads of 8, 2 KV heads, 2 layers, vocab 64
    # Per block: wq 32*32 + wk 32*16 + wv 32*16 + wo 32*32 = 3072; MLP 3*32*96 = 9216; norms 2*32 = 64.
    # N = 2 * (3072 + 9216 + 64) + final norm 32 + head 64*32 = 24704 + 32 + 2048 = 26784.
    assert non_embedding_params(cfg) == 26784
    # 6 * 26784 + 12 * 2 layers * 4 heads * 8 head_dim * 16 tokens = 160704 + 12288.
    assert flops_per_token(cfg, seq_len=16) == 172992.0
    assert count_params(build(cfg)) == 26784 + 64 * 32  # the model adds the embedding table
