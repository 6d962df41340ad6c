"""The GPT-2 family (engine/families/gpt2): the worked example of docs/extending.md.

What a family gets through the interface, checked on the CPU: ``--plan`` memory equal to the
real (and meta) build, its FLOPs count from the model's own parameters, activation
checkpointing that keeps gradients, its settings checks (exit 2 naming the field), the
registry (``model.family``, a family registered by another package). The FSDP and TP parity
runs are in tests/distributed/test_gpt2_family.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kforge_cli.engine.families import registry
from kforge_cli.engine.families.base import ModelFamily
from kforge_cli.engine.families.gpt2 import FAMILY, GPT2, GPT2Family
from kforge_cli.engine.plan.param_shards import chunk_size
from kforge_cli.engine.plan.planner import build_plan
from kforge_cli.errors import ConfigError
from kforge_cli.settings import JobSettings, load_settings
from tests.helpers import tiny

GPT2_SETTINGS = ["--model.family=gpt2", "--model.norm=layernorm", "--model.activation=gelu"]
# 64 wide, 4 blocks, 4 heads, 320-token vocabulary, 64 positions: the parity model's shape.
GPT2_TINY = [*GPT2_SETTINGS, *tiny.model(64, 4, 4, 4, vocab_size=320, max_seq_len=64), "--train.seq_len=32"]


def _settings(*overrides: str) -> JobSettings:
    return load_settings(overrides=[*GPT2_TINY, *tiny.CPU_FP32, *overrides]).settings


def test_model_family_selects_gpt2_and_counts_its_parameters() -> None:
    s = _settings()
    family = registry.family_for(s.model)
    assert family is FAMILY
    torch.manual_seed(0)
    model = family.build(s.model)
    assert isinstance(model, GPT2)
    assert family.param_count(s.model) == sum(p.numel() for p in model.parameters())
    tied = _settings("--model.tie_embeddings=true").model
    assert family.param_count(tied) == sum(p.numel() for p in family.build(tied).parameters())


def test_flops_per_token_is_the_palm_count_of_the_models_own_parameters() -> None:
    """6 N + 12 L H d T, N = every parameter but the token and position tables, the head once."""
    s = _settings()
    model = FAMILY.build(s.model)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte.", "wpe.")))
    seq = s.train.seq_len
    want = 6 * n + 12 * 4 * 4 * 16 * seq
    assert FAMILY.flops_per_token(s.model, seq) == want
    plan = build_plan(s, 1, 0)
    assert plan.throughput.flops_per_token == want  # --plan and MFU use the family's count


def test_plan_memory_is_the_real_builds() -> None:
    """One process: parameters, gradients and AdamW state of the plan are the real model's bytes."""
    from kforge_cli.engine.parallel import build_parallel_model
    from kforge_cli.engine.runtime import init_runtime
    from kforge_cli.engine.train.optim.optimizer import build_optimizer

    s = _settings()
    model, _ = build_parallel_model(s, init_runtime(s))
    optimizer = build_optimizer(model, s.optimizer)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values())
    plan = build_plan(s, 1, 0)
    assert plan.item("parameters").bytes == params
    assert plan.item("gradients").bytes == params
    assert plan.item("optimizer state").bytes == state


def _shapes(s: JobSettings) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in GPT2(s.model).named_parameters()}


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_under_fsdp_holds_fsdp2s_dim0_chunks(rank: int) -> None:
    s = _settings()
    want = 0
    for shape in _shapes(s).values():
        rest = 1
        for d in shape[1:]:
            rest *= d
        want += chunk_size(shape[0], 2, rank) * rest
    assert build_plan(s, 2, rank).local_params == want


def test_plan_under_tp2_splits_what_the_family_plan_splits() -> None:
    """tp=2 (+SP): q/k/v/fc and their biases, out_proj/proj weights, the token table and the head
    are halved; position table, LayerNorms and row-parallel biases stay whole on each rank."""
    s = _settings("--distributed.tp=2")
    halved, whole = 0, 0
    for name, shape in _shapes(s).items():
        numel = 1
        for d in shape:
            numel *= d
        leaf = name.split(".")
        split = name.startswith(("wte.", "output.")) or (
            leaf[-2] in ("q_proj", "k_proj", "v_proj", "fc", "out_proj", "proj")
            and not (leaf[-2] in ("out_proj", "proj") and leaf[-1] == "bias")
        )
        if split:
            halved += numel
        else:
            whole += numel
    assert build_plan(s, 2, 0).local_params == halved // 2 + whole


def test_activation_checkpointing_keeps_the_gradients() -> None:
    from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing

    s = _settings("--train.activation_checkpointing=full")
    torch.manual_seed(0)
    plain = FAMILY.build(s.model)
    checkpointed = FAMILY.build(s.model)
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed, s.train) == 4
    tokens = torch.randint(0, 320, (2, 32))
    for m in (plain, checkpointed):
        m(tokens).float().square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_settings_the_family_cannot_build_are_exit_2_naming_the_field() -> None:
    s = load_settings(overrides=["--model.family=gpt2", *tiny.CPU_FP32]).settings  # rmsnorm, swiglu, GQA
    with pytest.raises(ConfigError) as err:
        FAMILY.build(s.model)
    assert err.value.exit_code == 2
    assert {i.path for i in err.value.issues} == {"model.norm", "model.activation", "model.n_kv_heads"}


def test_a_family_without_a_cp_plan_is_refused_under_cp() -> None:
    from kforge_cli.engine.parallel.build import check_family_supports
    from kforge_cli.engine.runtime import RuntimeContext
    from kforge_cli.engine.runtime.launcher import LaunchInfo
    from kforge_cli.settings import ParallelDims

    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1, cp=2)
    runtime = RuntimeContext(
        launch=LaunchInfo("torchrun", 0, 0, 2, "localhost", 29500), device=torch.device("cpu"), dims=dims
    )
    with pytest.raises(ConfigError) as err:
        check_family_supports(_settings(), runtime)
    assert [i.path for i in err.value.issues] == ["distributed.cp"]


def test_unknown_family_is_exit_2_naming_model_family() -> None:
    s = load_settings(overrides=["--model.family=nope", *tiny.CPU_FP32]).settings
    with pytest.raises(ConfigError) as err:
        registry.family_for(s.model)
    assert [i.path for i in err.value.issues] == ["model.family"]
    assert "gpt2" in str(err.value) and "llama" in str(err.value)


class _Mine(GPT2Family):
    name = "gpt2-mine"  # a user's family: here GPT-2 under another name


def test_a_registered_family_is_usable_by_name() -> None:
    """What a package's entry point does (``kforge.families``), done in-process."""
    mine = registry.register_family(_Mine())
    try:
        s = _settings("--model.family=gpt2-mine")
        assert registry.family_for(s.model) is mine
        assert "gpt2-mine" in registry.family_names()
        assert build_plan(s, 1, 0).local_params == mine.param_count(s.model)
        with pytest.raises(ValueError, match="already registered"):
            registry.register_family(_Mine())
    finally:
        registry._REGISTERED.pop("gpt2-mine", None)


def test_register_family_wants_a_model_family() -> None:
    with pytest.raises(TypeError):
        registry.register_family(nn.Linear(1, 1))  # type: ignore[arg-type]
    assert isinstance(FAMILY, ModelFamily)


def test_kv_cache_decoding_equals_the_full_forward() -> None:
    """generate's KV cache works for the family: prefix then token by token = one full forward."""
    from kforge_cli.engine.model.kv_cache import KVCache

    s = _settings()
    torch.manual_seed(0)
    model = FAMILY.build(s.model).eval()
    tokens = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(16)
        steps = [model(tokens[:, :8], kv_cache=cache)] + [
            model(tokens[:, i : i + 1], kv_cache=cache) for i in range(8, 12)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_the_default_family_keeps_the_fingerprint_of_runs_before_families() -> None:
    """A Llama run's shaping config has no model.family (its checkpoints resume as before); gpt2's has it."""
    from kforge_cli.rundir.fingerprint import shaping_config

    llama = shaping_config(load_settings(overrides=list(tiny.CPU_FP32)).settings)
    assert not any(k == "model.family" for k in llama)
    assert shaping_config(_settings())["model.family"] == "gpt2"
