"""Param groups, AdamW / Lion / Muon updates against hand or torch references, Newton-Schulz, state dicts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kforge_cli.engine.model.module_names import clean_param_name
from kforge_cli.engine.train.optim.lion import Lion
from kforge_cli.engine.train.optim.muon import Muon, zeropower_via_newtonschulz
from kforge_cli.engine.train.optim.optimizer import build_optimizer, build_param_groups, use_fused_adamw
from kforge_cli.settings import JobSettings
from kforge_cli.settings.training import OptimizerSettings


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 2 * dim, bias=True)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.wq(self.attention_norm(x))
        return h + self.w2(torch.relu(self.w1(h)))


class Tiny(nn.Module):
    """Llama-like names: tok_embeddings, layers.N.*, norm, output."""

    def __init__(self, vocab: int = 16, dim: int = 8, tie: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_model(seed: int = 0, **kwargs: Any) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny(**kwargs)
    with torch.no_grad():  # non-trivial norm gains so their updates are visible
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def settings(**optimizer: Any) -> OptimizerSettings:
    return JobSettings(optimizer=optimizer).optimizer


def group_names(model: nn.Module, groups: list[dict[str, Any]]) -> dict[str, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}


def backward(model: Tiny, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 16, (2, 5), generator=gen)
    targets = torch.randint(0, 16, (2, 5), generator=gen)
    logits = model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1)).backward()


MATRICES = {"layers.0.wq.weight", "layers.0.w1.weight", "layers.0.w2.weight"}
ONE_D = {"layers.0.attention_norm.weight", "layers.0.w1.bias", "norm.weight"}


def test_default_groups_do_not_decay_norms_biases_or_embeddings() -> None:
    model = make_model()
    groups = group_names(model, build_param_groups(model, settings()))
    assert groups == {"decay": MATRICES | {"output.weight"}, "no_decay": ONE_D | {"tok_embeddings.weight"}}


def test_decay_norms_and_biases_and_embeddings_when_configured() -> None:
    model = make_model()
    norms = group_names(model, build_param_groups(model, settings(decay_norms_and_biases=True)))
    assert norms == {"decay": MATRICES | ONE_D | {"output.weight"}, "no_decay": {"tok_embeddings.weight"}}
    emb = group_names(model, build_param_groups(model, settings(decay_embeddings=True)))
    assert emb == {"decay": MATRICES | {"output.weight", "tok_embeddings.weight"}, "no_decay": ONE_D}
    raw = build_param_groups(model, settings(weight_decay=0.3))
    assert {g["name"]: g["weight_decay"] for g in raw} == {"decay": 0.3, "no_decay": 0.0}


def test_tied_head_counts_once_as_an_embedding() -> None:
    model = make_model(tie=True)
    groups = group_names(model, build_param_groups(model, settings()))
    assert groups == {"decay": MATRICES, "no_decay": ONE_D | {"tok_embeddings.weight"}}


def test_embeddings_by_name_and_wrapper_prefixes() -> None:
    model = make_model()
    model.pos_embeddings = nn.Parameter(torch.zeros(4, 8))
    groups = group_names(model, build_param_groups(model, settings()))
    assert "pos_embeddings" in groups["no_decay"]
    assert clean_param_name("_orig_mod.layers.0._checkpoint_wrapped_module.wq.weight") == "layers.0.wq.weight"


def test_frozen_parameters_are_included_and_skipped_until_they_have_grads() -> None:
    model = make_model()
    model.layers[0].wq.weight.requires_grad_(False)
    opt = build_optimizer(model, settings())
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert params == {id(p) for p in model.parameters()}
    before = model.layers[0].wq.weight.detach().clone()
    backward(model, seed=1)
    opt.step()
    assert torch.equal(model.layers[0].wq.weight, before)
    assert model.layers[0].wq.weight not in opt.state


def test_adamw_matches_torch_adamw_with_the_same_groups() -> None:
    cfg = settings(name="adamw", lr=1e-2, weight_decay=0.2, betas=(0.8, 0.9), eps=1e-6)
    ours, ref = make_model(seed=3), make_model(seed=3)
    opt = build_optimizer(ours, cfg)
    names = dict(ref.named_parameters())
    by_name = group_names(ours, opt.param_groups)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [names[n] for n in sorted(by_name["decay"])], "weight_decay": 0.2},
            {"params": [names[n] for n in sorted(by_name["no_decay"])], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.8, 0.9),
        eps=1e-6,
        foreach=False,
    )
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"] is True  # CPU: foreach, not fused
    for step in range(2):
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            optimizer.zero_grad()
            backward(model, seed=10 + step)
            optimizer.step()
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(ours.tok_embeddings.weight, make_model(seed=3).tok_embeddings.weight)


def test_fused_selection() -> None:
    cpu = [torch.zeros(2)]
    assert use_fused_adamw(cpu, None) is False
    assert use_fused_adamw(cpu, True) is True
    assert use_fused_adamw(cpu, False) is False
    opt = build_optimizer(make_model(), settings(fused=True))  # torch has a CPU fused kernel too
    assert opt.defaults["fused"] is True


def test_optimizer_state_dtype_follows_bf16_params() -> None:
    model = make_model().to(torch.bfloat16)
    opt = build_optimizer(model, settings())
    backward(model, seed=2)
    opt.step()
    assert opt.state[model.output.weight]["exp_avg"].dtype == torch.bfloat16


def test_lion_two_steps_match_the_formula() -> None:
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    lr, wd, b1, b2 = 0.1, 0.5, 0.9, 0.99
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    g1 = torch.tensor([0.3, -0.2, 0.0])
    g2 = torch.tensor([-0.01, -0.5, 1.0])
    p.grad = g1.clone()
    opt.step()
    # step 1: m=0, c = (1-b1) g1 -> sign(g1) = [1, -1, 0]
    expected = torch.tensor([1.0, -2.0, 0.5]) * (1 - lr * wd) - lr * torch.tensor([1.0, -1.0, 0.0])
    torch.testing.assert_close(p.detach(), expected)
    m = (1 - b2) * g1
    torch.testing.assert_close(opt.state[p]["exp_avg"], m)
    p.grad = g2.clone()
    opt.step()
    # step 2: c = b1 m + (1-b1) g2 = [0.0027-0.001, ...]: sign [+1, -1, +1]
    c = b1 * m + (1 - b1) * g2
    assert torch.equal(c.sign(), torch.tensor([1.0, -1.0, 1.0]))
    expected = expected * (1 - lr * wd) - lr * c.sign()
    torch.testing.assert_close(p.detach(), expected)
    torch.testing.assert_close(opt.state[p]["exp_avg"], b2 * m + (1 - b2) * g2)


def test_build_lion_uses_the_groups() -> None:
    model = make_model()
    opt = build_optimizer(model, settings(name="lion", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99)))
    assert isinstance(opt, Lion)
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups} == {"decay": 0.1, "no_decay": 0.0}
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48)])
def test_newton_schulz_is_nearly_orthogonal(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randn(*shape, generator=gen)
    out = zeropower_via_newtonschulz(matrix, steps=5)
    assert out.shape == matrix.shape and out.dtype == matrix.dtype
    singular = torch.linalg.svdvals(out)
    # Muon's quintic trades exactness for speed: singular values land in roughly [0.7, 1.2].
    assert singular.min().item() > 0.5 and singular.max().item() < 1.5
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    polar = u @ vh  # the exact orthogonal factor: NS must point the same way
    cosine = (out * polar).sum() / (out.norm() * polar.norm())
    assert cosine.item() > 0.97
    bf16 = zeropower_via_newtonschulz(matrix, steps=5, dtype=torch.bfloat16)
    torch.testing.assert_close(bf16, out, atol=0.05, rtol=0.1)


def test_muon_groups_route_hidden_matrices_only() -> None:
    model = make_model()
    opt = build_optimizer(model, settings(name="muon", lr=1e-3, muon_lr=0.05))
    assert isinstance(opt, Muon)
    groups = group_names(model, opt.param_groups)
    assert groups == {"muon": MATRICES, "decay": {"output.weight"}, "no_decay": ONE_D | {"tok_embeddings.weight"}}
    assert {g["name"]: (g["use_muon"], g["lr"]) for g in opt.param_groups} == {
        "muon": (True, 0.05),
        "decay": (False, 1e-3),
        "no_decay": (False, 1e-3),
    }


def test_muon_step_matches_hand_computation_and_torch_adamw_for_the_rest() -> None:
    cfg = settings(name="muon", lr=1e-2, muon_lr=0.05, weight_decay=0.1, muon_momentum=0.9, muon_ns_steps=5)
    ours, ref = make_model(seed=4), make_model(seed=4)
    opt = build_optimizer(ours, cfg)
    names = dict(ref.named_parameters())
    by_name = group_names(ours, opt.param_groups)
    ref_adamw = torch.optim.AdamW(
        [
            {"params": [names[n] for n in sorted(by_name["decay"])], "weight_decay": 0.1},
            {"params": [names[n] for n in sorted(by_name["no_decay"])], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=cfg.betas,
        eps=cfg.eps,
        foreach=False,
    )
    backward(ours, seed=7)
    backward(ref, seed=7)
    w1_before = names["layers.0.w1.weight"].detach().clone()  # [16, 8]: rows > cols
    g = names["layers.0.w1.weight"].grad.clone()
    opt.step()
    ref_adamw.step()
    # Muon by hand: buf = g; nesterov update = g + 0.9 buf; scale sqrt(16/8).
    expected = w1_before * (1 - 0.05 * 0.1) - 0.05 * zeropower_via_newtonschulz(g * 1.9, 5) * 2**0.5
    torch.testing.assert_close(ours.layers[0].w1.weight.detach(), expected, rtol=1e-5, atol=1e-6)
    for name in by_name["decay"] | by_name["no_decay"]:
        torch.testing.assert_close(dict(ours.named_parameters())[name], names[name], rtol=1e-6, atol=1e-7, msg=name)


def test_muon_trains_a_tiny_regression() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    inputs = torch.randn(128, 16)
    targets = torch.sin(inputs[:, :4] * 2.0) + inputs[:, 4:8]
    opt = build_optimizer(model, settings(name="muon", lr=1e-2, muon_lr=0.02, weight_decay=0.0))
    assert sum(g["use_muon"] for g in opt.param_groups) == 1
    losses = []
    for _ in range(50):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


def test_muon_rejects_non_matrices_in_muon_groups() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])


@pytest.mark.parametrize("name", ["adamw", "lion", "muon"])
def test_state_dict_holds_only_tensors(name: str) -> None:
    model = make_model()
    opt = build_optimizer(model, settings(name=name))
    backward(model, seed=5)
    opt.step()
    state = opt.state_dict()["state"]
    assert len(state) == sum(1 for _ in model.parameters())
    for per_param in state.values():
        assert per_param and all(isinstance(v, torch.Tensor) for v in per_param.values()), per_param
