"""MoE layers: grouped GEMM == per-expert loop, zero-token experts train, routing rules, balancing, settings."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model.moe import GroupedExperts, MoEFeedForward, finish_moe_step, moe_aux_loss
from kforge_cli.errors import ConfigError
from kforge_cli.settings import load_settings
from kforge_cli.settings.training import ModelSettings

torch.set_num_threads(1)


def tiny(**moe: object) -> ModelSettings:
    base: dict[str, object] = {"num_experts": 4, "top_k": 2, "expert_hidden_dim": 16}
    base.update(moe)
    return ModelSettings(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, moe=base)


def test_grouped_gemm_equals_per_expert_loop_forward_and_grads() -> None:
    torch.manual_seed(0)
    grouped = GroupedExperts(dim=32, hidden=16, num_experts=4, use_grouped_mm=True)
    grouped.init_weights(0.5, 0.5)
    loop = GroupedExperts(dim=32, hidden=16, num_experts=4, use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([5, 0, 9, 2])  # expert 1 gets no tokens
    x = torch.randn(16, 32)
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(16, 32)
    yg, yl = grouped(xg, counts), loop(xl, counts)
    yg.backward(g)
    yl.backward(g)
    torch.testing.assert_close(yg, yl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xg.grad, xl.grad, rtol=1e-5, atol=1e-6)
    for name in ("w1", "w2", "w3"):
        pg, pl = getattr(grouped, name).grad, getattr(loop, name).grad
        assert pg is not None and pl is not None
        torch.testing.assert_close(pg, pl, rtol=1e-5, atol=1e-6)
        assert torch.count_nonzero(pg[1]) == 0  # the zero-token expert's gradient is zero, not missing


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_a_forced_zero_token_expert_trains(use_grouped_mm: bool) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny(bias_update_rate=1e-3, grouped_mm=use_grouped_mm))
    for layer in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
        layer.expert_bias[0] = -100.0  # expert 0 is never selected
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(3):
        opt.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        w1 = model.layers["0"].feed_forward.experts.w1
        assert w1.grad is not None and torch.count_nonzero(w1.grad[0]) == 0 and torch.count_nonzero(w1.grad[1:]) > 0
        opt.step()
        finish_moe_step(model)
    after = dict(model.named_parameters())
    w1_before, w1_after = before["layers.0.feed_forward.experts.w1"], after["layers.0.feed_forward.experts.w1"]
    assert torch.equal(w1_before[0], w1_after[0]) and not torch.equal(w1_before[1:], w1_after[1:])


def test_bias_changes_selection_but_not_gate_weights() -> None:
    torch.manual_seed(0)
    layer = Transformer(tiny(top_k=1, renormalize=False)).layers["0"].feed_forward
    assert isinstance(layer, MoEFeedForward)
    x = torch.randn(40, 32)
    plain = layer.router(x, None)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    biased = layer.router(x, bias)
    assert bool((biased.experts == 3).all()) and not bool((plain.experts == 3).all())
    torch.testing.assert_close(biased.weights, torch.softmax(biased.logits, -1)[:, 3:4])  # unbiased score


def test_group_limited_routing_stays_in_the_best_groups() -> None:
    torch.manual_seed(0)
    layer = Transformer(tiny(num_experts=8, n_groups=4, topk_groups=1, score_func="sigmoid")).layers["0"].feed_forward
    assert isinstance(layer, MoEFeedForward)
    r = layer.router(torch.randn(64, 32), None)
    groups = r.experts // 2
    assert bool((groups[:, 0] == groups[:, 1]).all())  # both experts from the token's one allowed group


def test_capacity_drops_and_counts_tokens() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny(capacity_factor=0.5)).train()
    model(torch.randint(0, 64, (2, 16)))
    metrics = finish_moe_step(model)
    # capacity = ceil(0.5 * 32 tokens * 2 / 4) = 8 per expert: 64 assignments, at most 32 kept
    assert metrics["moe/0/dropped"] >= 32 and metrics["moe/1/dropped"] >= 32


def test_counts_ignore_microbatch_split_and_checkpoint_recompute() -> None:
    torch.manual_seed(0)
    cfg = tiny(bias_update_rate=1e-2)
    whole, split = Transformer(cfg), Transformer(cfg)
    split.load_state_dict(whole.state_dict())
    tokens = torch.randint(0, 64, (4, 16))
    whole(tokens).sum().backward()
    for half in tokens.split(2):  # two micro-batches, each block under activation checkpointing
        h = split.tok_embeddings(half)
        cos, sin = split.rope_cos[:16], split.rope_sin[:16]
        for block in split.layers.values():
            h = checkpoint(block, h, cos, sin, None, use_reentrant=False)
        h.sum().backward()
    assert int(split.layers["0"].feed_forward.step_forwards) == 2  # recompute did not count
    m_whole, m_split = finish_moe_step(whole), finish_moe_step(split)
    assert m_whole == m_split
    for key in ("0", "1"):
        b = whole.layers[key].feed_forward.expert_bias
        assert torch.equal(b, split.layers[key].feed_forward.expert_bias) and b.abs().sum() > 0


def test_aux_and_z_loss_reach_the_router() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny(aux_loss_weight=0.01, z_loss_weight=0.001))
    model(torch.randint(0, 64, (2, 16)))
    aux = moe_aux_loss(model)
    assert aux is not None and aux.item() > 0
    aux.backward()
    assert model.layers["0"].feed_forward.router.gate.weight.grad.abs().sum() > 0
    assert moe_aux_loss(Transformer(tiny())) is None  # both weights 0: nothing to add


def test_moe_layer_choice() -> None:
    cfg = ModelSettings(dim=32, n_layers=5, n_heads=4, moe={"first_dense_layers": 1, "every_n_layers": 2})
    kinds = [type(b.feed_forward).__name__ for b in Transformer(cfg).layers.values()]
    assert kinds == ["FeedForward", "MoEFeedForward", "FeedForward", "MoEFeedForward", "FeedForward"]


def test_moe_settings_errors_name_the_key() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(
            overrides=[
                "--model.moe.num_experts=6",
                "--model.moe.top_k=8",
                "--model.moe.n_groups=4",
                "--model.moe.first_dense_layers=9",
            ]
        )
    paths = {i.path for i in exc.value.issues}
    assert {"model.moe.top_k", "model.moe.n_groups", "model.moe.first_dense_layers"} <= paths
    assert load_settings().settings.model.moe is None  # dense by default


def test_flops_count_active_params_and_plan_reports_experts() -> None:
    from kforge_cli.engine.model import count_params, non_embedding_params
    from kforge_cli.engine.plan.planner import build_plan

    s = load_settings("moe-debug", use_env=False).settings
    m = s.model
    with torch.device("meta"):
        model = Transformer(m)
    moe = m.moe
    assert moe is not None
    n_moe = sum(moe.is_moe_layer(i) for i in range(m.n_layers))
    one_expert = 3 * m.dim * moe.resolved_expert_hidden_dim(m)
    idle = n_moe * (moe.num_experts - moe.top_k) * one_expert
    embedding = m.vocab_size * m.dim
    assert count_params(model) == m.param_count()
    assert non_embedding_params(m) == count_params(model) - embedding - idle
    assert m.param_count(active=True) == count_params(model) - idle
    plan = build_plan(s, 1)
    expert_bytes = n_moe * moe.num_experts * one_expert * 4
    assert f"expert weights on this rank {expert_bytes / 2**20:.2f} MiB" in " ".join(plan.notes)


def test_expert_parallel_settings_errors_name_the_key() -> None:
    from kforge_cli.settings import resolve_dims

    def issues(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as exc:
            load_settings(overrides=list(overrides), use_env=False)
        return [str(i) for i in exc.value.issues]

    assert issues("--distributed.ep=2") == [
        "distributed.ep: 2 needs a Mixture-of-Experts model: add [model.moe] or set ep = 1"
    ]
    assert issues("--model.moe.num_experts=6", "--distributed.ep=4") == [
        "distributed.ep: 4 does not divide model.moe.num_experts (6)"
    ]
    assert (
        "distributed.ep: 4 does not divide distributed.dp_shard (2)"
        in issues("--model.moe.num_experts=8", "--distributed.ep=4", "--distributed.dp_shard=2")[0]
    )
    s = load_settings(overrides=["--model.moe.num_experts=8", "--distributed.ep=4"], use_env=False).settings
    with pytest.raises(ConfigError, match=r"distributed.ep: 4 does not divide distributed.dp_shard \(6\)"):
        resolve_dims(s, 6)  # dp_shard = -1: known only with the world size
    assert resolve_dims(s, 8).ep == 4


def test_expert_parallel_mesh_splits_dp_shard_and_plan_reports_ep() -> None:
    from kforge_cli.engine.plan.planner import build_plan
    from kforge_cli.engine.runtime import mesh_shape
    from kforge_cli.settings.parallel_dims import ParallelDims

    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=4, tp=1, ep=2)
    assert mesh_shape(dims) == [("dp_replicate", 2), ("dp_shard_mod_ep", 2), ("ep", 2)]
    s = load_settings("moe-debug", overrides=["--distributed.ep=2"], use_env=False).settings
    moe = s.model.moe
    assert moe is not None
    plan = build_plan(s, 2)  # a meta build on a fake 2-rank mesh: experts Shard(0) over ep
    n_moe = sum(moe.is_moe_layer(i) for i in range(s.model.n_layers))
    one_expert = 3 * s.model.dim * moe.resolved_expert_hidden_dim(s.model)
    notes = " ".join(plan.notes)
    assert f"{moe.num_experts // 2} of {moe.num_experts} experts each (ep = 2)" in notes
    assert f"expert weights on this rank {n_moe * moe.num_experts // 2 * one_expert * 4 / 2**20:.2f} MiB" in notes
    t = s.train
    one_way = t.batch_size * t.seq_len * t.grad_accum_steps * moe.top_k * s.model.dim * 4 // 2  # fp32 on CPU
    assert f"MoE all-to-all: {2 * 2 * one_way * n_moe / 2**20:.2f} MiB" in notes


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_experts_given_no_rows_at_all_keep_a_zero_gradient(use_grouped_mm: bool) -> None:
    """An expert-parallel rank whose experts got no token in a micro-batch: empty output, zero gradients."""
    experts = GroupedExperts(32, 32, 2, use_grouped_mm)
    experts.init_weights(0.02, 0.02)
    out = experts(torch.zeros(0, 32, requires_grad=True), torch.zeros(2, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0, 32)
    for w in (experts.w1, experts.w2, experts.w3):
        assert w.grad is not None and w.grad.abs().sum() == 0


def test_tensor_parallel_is_allowed_when_it_divides_the_shared_experts() -> None:
    from kforge_cli.settings import resolve_dims

    moe = ["--model.moe.num_experts=4", "--model.moe.num_shared_experts=1", "--distributed.tp=2"]
    s = load_settings(overrides=[*moe, "--model.moe.expert_hidden_dim=64"], use_env=False).settings
    assert resolve_dims(s, 4).tp == 2  # no longer refused
    s = load_settings(overrides=[*moe, "--model.moe.expert_hidden_dim=33"], use_env=False).settings
    with pytest.raises(
        ConfigError, match=r"distributed.tp: 2 does not divide the MoE shared experts' hidden size \(33\)"
    ):
        resolve_dims(s, 2)


def test_plan_under_tensor_parallel_splits_the_shared_experts_only() -> None:
    """tp = 2: attention, dense MLP, shared experts, embedding and head halve; router and routed experts stay whole."""
    from kforge_cli.engine.plan.planner import build_plan
    from kforge_cli.settings.moe import active_ffn_hidden

    s = load_settings("moe-debug", overrides=["--distributed.tp=2"], use_env=False).settings
    m, moe = s.model, s.model.moe
    assert moe is not None
    plan = build_plan(s, 2)  # a meta build on a fake 2-rank mesh (tp = 2, dp_shard = 1)
    with torch.device("meta"):
        full = dict(Transformer(m).named_parameters())
    whole = sum(p.numel() for n, p in full.items() if ".experts." in n or ".router." in n or "norm" in n)
    split = sum(p.numel() for p in full.values()) - whole
    assert plan.mesh["tp"] == 2 and plan.local_params == whole + split // 2
    n_moe = sum(moe.is_moe_layer(i) for i in range(m.n_layers))
    hidden = moe.resolved_expert_hidden_dim(m)
    notes = " ".join(plan.notes)
    assert f"expert weights on this rank {n_moe * moe.num_experts * 3 * m.dim * hidden * 4 / 2**20:.2f} MiB" in notes
    assert "MoE x TP: shared experts split over them, router and routed experts whole on each of the tp = 2" in notes
    # activation estimate: top_k routed experts whole + the shared expert's half, per TP rank
    assert active_ffn_hidden(m, 2) == moe.top_k * hidden + hidden // 2


class _GroupedGemmDtypes(TorchDispatchMode):
    """Records the dtypes of every grouped GEMM's two operands (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "overloadpacket", None) is torch.ops.aten._grouped_mm:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_under_cpu_bf16_autocast_experts_run_bf16_grouped_gemms_and_the_router_fp32_logits() -> None:
    """One process with train.dtype = bf16 runs under autocast with an fp32 residual stream: the
    routed experts must still take bf16 grouped GEMMs (autocast has no rule for them; fp32 is
    torch's slow fallback on GPU), and the router's logits must stay fp32 (F.linear's autocast
    rule would make them bf16)."""
    torch.manual_seed(0)
    model = Transformer(tiny(z_loss_weight=1e-3))
    model.init_weights()
    logits: list[torch.dtype] = []
    for layer in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
        layer.router.register_forward_hook(lambda _m, _i, out: logits.append(out.logits.dtype))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with _GroupedGemmDtypes() as gemms:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens).float().logsumexp(-1).mean()
            aux = moe_aux_loss(model)
            assert aux is not None
            loss = loss + aux
        loss.backward()
    assert logits == [torch.float32, torch.float32]  # both MoE layers' routers
    assert len(gemms.seen) >= 2 * 3 * 3  # 2 layers x 3 GEMMs forward, and their input/weight gradients
    assert set(gemms.seen) == {(torch.bfloat16, torch.bfloat16)}, gemms.seen
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("inference_grad", [False, True], ids=["torch-2.11-no-grad", "torch-2.13-grad"])
def test_pipeline_aux_feed_skips_the_schedules_shape_inference_forward_in_either_grad_mode(
    inference_grad: bool,
) -> None:
    """A pipeline schedule's first step runs one forward per stage on stand-in (zero) activations to
    infer shapes: torch 2.11 under no_grad, 2.13 with grad. Either way it is not a micro-batch (no aux
    gradient, no load) and the step still counts one training forward per micro-batch."""
    from kforge_cli.engine.train.features.moe_aux import AuxLossFeed

    torch.manual_seed(0)
    model = Transformer(tiny(bias_update_rate=1e-3, aux_loss_weight=1e-2))
    model.init_weights()
    model.train()
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    feed = AuxLossFeed([model])
    feed.start(torch.tensor([0.5, 0.5]), infers_metadata=True)
    with torch.set_grad_enabled(inference_grad):
        model(torch.zeros(2, 16, dtype=torch.long))  # the stand-in forward
    for layer in layers:
        assert int(layer.step_tokens.sum()) == 0  # its token counts were cleared
    for seed in (1, 2):  # the two micro-batches
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(tokens).float().logsumexp(-1).mean().backward()
    feed.finish()  # one forward per micro-batch after the stand-in: no error
    for layer in layers:
        assert int(layer.step_tokens.sum()) == 2 * 2 * 16 * 2  # 2 micro-batches x 32 tokens x top-2
