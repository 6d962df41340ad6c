"""MoE with the other per-block features: torch.compile, op-level activation checkpointing, float8.

- A compiled MoE model (``train.compile_model``, built by ``build_parallel_model``) traces each
  block in one graph on CPU fp32 and trains exactly like eager: capacity dropping (data-dependent
  row counts) and op-level selective AC (side effects inside the checkpoint) together.
- Op-level selective AC saves the experts' grouped GEMMs (no recompute in the backward) and
  gives the gradients of no AC.
- float8 converts the dense linears of an MoE block (attention, shared experts), never the
  router or the routed experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model.moe import MoEFeedForward, finish_moe_step, moe_aux_loss
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing
from kforge_cli.engine.parallel.float8 import float8_filter
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.settings import load_settings
from tests.helpers import tiny

MOE = [
    *tiny.model(32, 2, 4, vocab_size=64, max_seq_len=16),
    *tiny.moe(expert_hidden_dim=16),
    "--train.seq_len=16",
    *tiny.CPU_FP32,
    *tiny.ONE_THREAD,
]
SELECTIVE_OP = ["--train.activation_checkpointing=selective", "--train.ac_selective_mode=op"]


@pytest.fixture(autouse=True)
def _restore_dynamo_config() -> Iterator[None]:
    """Compiling an MoE model sets process-wide dynamo flags (allow_moe_tracing): undo them after each test."""
    saved = torch._dynamo.config.save_config()
    yield
    torch._dynamo.config.load_config(saved)


def _train(overrides: list[str], steps: int = 3) -> tuple[list[float], list[int], list[torch.Tensor]]:
    """Losses (+ aux) of ``steps`` SGD steps, forwards counted per step, and the final expert biases."""
    s = load_settings(overrides=[*MOE, *overrides], use_env=False).settings
    torch.manual_seed(0)
    model, _ = build_parallel_model(s, init_runtime(s))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    losses, forwards = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 17), generator=data)
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        aux = moe_aux_loss(model)
        assert aux is not None
        (loss + aux).backward()
        opt.step()
        opt.zero_grad()
        forwards.append(int(model.get_submodule("layers.0.feed_forward").step_forwards))
        finish_moe_step(model)
        losses.append((loss + aux).item())
    biases = [m.expert_bias.clone() for m in model.modules() if isinstance(m, MoEFeedForward)]
    return losses, forwards, biases


ONE_BLOCK = ["--model.n_layers=1"]  # compile time is per distinct block graph: one is enough


def test_compiled_moe_blocks_are_one_graph_and_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on CPU: the traced grouped GEMM takes only bf16, so compiled experts run the loop.

    The blocks compile with ``aot_eager_decomp_partition``: dynamo, decompositions and the AC
    min-cut partitioner as under Inductor, minus its C++ code generation (~40 s cold on 2 cores).
    Measured with Inductor too: the compiled losses equal eager's bit for bit (and a 2-rank
    ``distributed.ep = 2`` run's equal one process's within 2e-7 over 10 steps); 1e-5 relative
    leaves room for fused arithmetic elsewhere.
    """
    from torch._dynamo.utils import counters

    from kforge_cli.engine.parallel import build

    compiled_with: list[bool] = []
    real_compile = build.apply_compile

    def compile_without_codegen(module: nn.Module, *, fullgraph: bool = True) -> None:
        compiled_with.append(fullgraph)
        real_compile(module, fullgraph=fullgraph, backend="aot_eager_decomp_partition")

    monkeypatch.setattr(build, "apply_compile", compile_without_codegen)
    torch._dynamo.reset()
    counters.clear()
    features = [*SELECTIVE_OP, "--model.moe.capacity_factor=1.0"]
    eager = _train([*features, *ONE_BLOCK])
    compiled = _train([*features, *ONE_BLOCK, "--train.compile_model=true"])
    assert compiled_with == [True]  # MoE blocks are compiled with fullgraph=True ...
    assert not counters["graph_break"], dict(counters["graph_break"])  # ... and trace in one graph each
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5, abs=0)
    assert compiled[1] == eager[1] == [1, 1, 1]  # the checkpoint's recompute counted no tokens
    for got, want in zip(compiled[2], eager[2], strict=True):
        assert torch.equal(got, want) and want.abs().sum() > 0


class _CountGroupedGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "overloadpacket", None) is torch.ops.aten._grouped_mm:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_grouped_gemms(ac: list[str]) -> tuple[int, dict[str, torch.Tensor]]:
    s = load_settings(overrides=[*MOE, *ac], use_env=False).settings
    torch.manual_seed(0)
    model = Transformer(s.model)
    model.init_weights()
    apply_activation_checkpointing(model, s.train)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).float().logsumexp(-1).mean()
    with _CountGroupedGemms() as counter:
        loss.backward()
    return counter.count, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_selective_op_ac_saves_grouped_gemms_and_keeps_no_ac_gradients() -> None:
    none, want = _backward_grouped_gemms([])
    full, full_grads = _backward_grouped_gemms(["--train.activation_checkpointing=full"])
    got, grads = _backward_grouped_gemms(SELECTIVE_OP)
    assert full > none > 0  # the counter sees the gradients' grouped GEMMs and full AC's recompute
    assert got == none, f"op AC: {got} grouped GEMMs in backward, {none} without AC, {full} with full AC"
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"op AC: {name}")
        torch.testing.assert_close(full_grads[name], g, rtol=1e-5, atol=1e-7, msg=f"full AC: {name}")


def _meta_moe_model() -> nn.Module:
    with torch.device("meta"):
        return Transformer(load_settings(overrides=MOE, use_env=False).settings.model)


FLOAT8_IN_AN_MOE_BLOCK = {
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.shared_experts.w1",
    "feed_forward.shared_experts.w2",
    "feed_forward.shared_experts.w3",
}


def test_float8_converts_attention_and_shared_experts_not_router_or_routed_experts() -> None:
    model = _meta_moe_model()
    keep = float8_filter()
    chosen = {n.split(".", 2)[2] for n, m in model.named_modules() if n.startswith("layers.") and keep(m, n)}
    assert chosen == FLOAT8_IN_AN_MOE_BLOCK
    assert not keep(model.get_submodule("layers.0.feed_forward.router.gate"), "layers.0.feed_forward.router.gate")
    # The routed experts are stacked parameters, no nn.Linear torchao could swap.
    assert not [n for n, m in model.named_modules() if ".experts" in n and isinstance(m, nn.Linear)]


def test_float8_swap_of_an_moe_model_keeps_router_and_experts() -> None:
    pytest.importorskip("torchao.float8")
    from kforge_cli.engine.parallel.float8 import apply_float8

    model = _meta_moe_model()
    assert apply_float8(model, recipe="tensorwise", fsdp_float8_all_gather=False) == 2 * len(FLOAT8_IN_AN_MOE_BLOCK)
    assert type(model.get_submodule("layers.1.feed_forward.router.gate")) is nn.Linear
    assert type(model.get_submodule("layers.1.feed_forward.shared_experts.w1")) is not nn.Linear


def test_compiled_grouped_experts_take_a_run_time_empty_input() -> None:
    """bf16 grouped GEMM traced with a data-dependent row count that turns out 0 at run time
    (an EP rank whose experts got no token): forward and backward run, gradients are zero.
    Without the padding row the weight-gradient grouped GEMM gets an empty operand and raises."""
    from kforge_cli.engine.model.moe import GroupedExperts
    from kforge_cli.engine.parallel.build import allow_moe_tracing

    allow_moe_tracing()
    torch._dynamo.reset()
    experts = GroupedExperts(32, 32, 2).to(torch.bfloat16)
    experts.init_weights(0.02, 0.02)

    def routed(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        rows = x[keep]  # a row count known only at run time
        counts = torch.stack([rows.new_zeros((), dtype=torch.long), keep.sum()])
        return experts(rows, counts)

    compiled = torch.compile(routed, fullgraph=True, backend="aot_eager_decomp_partition")
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    for keep in (torch.tensor([True, False] * 4), torch.zeros(8, dtype=torch.bool)):
        out = compiled(x, keep)
        assert out.shape == (int(keep.sum()), 32)
        (out.float().sum() + 1).backward()
    for w in (experts.w1, experts.w2, experts.w3):
        assert w.grad is not None and torch.isfinite(w.grad.float()).all()
