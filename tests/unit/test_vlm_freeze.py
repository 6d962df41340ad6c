"""Freeze specs and schedules, the resume check, and the zero optimizer state that keeps frozen modules resumable."""

from __future__ import annotations

import pytest
import torch

from kforge_cli.engine.model.vlm import build_vlm, check_specs, freeze_mismatch, frozen_names, frozen_specs_at
from kforge_cli.engine.model.vlm.freeze import freeze_record
from kforge_cli.engine.train.features.vlm_freeze import init_optimizer_state
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.vlm import VLMSettings
from tests.unit.test_vlm_model import vlm_settings

SCHEDULE = VLMSettings(
    freeze=["embeddings"],
    freeze_schedule=[
        {"start_step": 0, "freeze": ["vision", "adapter"]},
        {"start_step": 5, "freeze": ["vision"]},
        {"start_step": 9, "freeze": []},
    ],
)


def test_the_freeze_at_a_step_is_the_base_plus_the_last_started_stage() -> None:
    assert frozen_specs_at(SCHEDULE, 0) == ("adapter", "embeddings", "vision")
    assert frozen_specs_at(SCHEDULE, 4) == ("adapter", "embeddings", "vision")
    assert frozen_specs_at(SCHEDULE, 5) == ("embeddings", "vision")  # the update after step 5 trains the adapter
    assert frozen_specs_at(SCHEDULE, 9) == ("embeddings",)
    assert frozen_specs_at(VLMSettings(), 100) == ()
    assert freeze_record(SCHEDULE, 7) == {"step": 7, "frozen": ["embeddings", "vision"]}
    assert freeze_record(None, 7) is None


def test_aliases_and_patterns_select_parameters() -> None:
    model = build_vlm(vlm_settings("--vlm.arch=mot"))
    names = [n for n, _ in model.named_parameters()]
    vision = frozen_names(names, ["vision"])
    assert vision and all(n.startswith("vision.") for n in vision)
    assert vision == {n for n in names if n.startswith("vision.")}
    assert frozen_names(names, ["adapter"]) == {n for n in names if n.startswith("adapter.")}
    image = frozen_names(names, ["experts.image"])
    assert image == {n for n in names if ".experts.image." in n}
    assert frozen_names(names, ["layers.0"]) == {n for n in names if n.startswith("layers.0.")}
    assert frozen_names(names, ["layers.*.feed_forward.*"]) == {n for n in names if ".feed_forward." in n}
    lm = frozen_names(names, ["language_model"])
    assert lm == {n for n in names if not n.startswith(("vision.", "adapter."))}
    # wrapper segments inserted by compile / AC do not hide a parameter
    assert frozen_names(["vision._orig_mod.layers.0.norm1.weight"], ["vision"]) == {"vision.layers.0.norm1.weight"}


def test_a_spec_that_matches_nothing_is_an_error_naming_it() -> None:
    model = build_vlm(vlm_settings("--vlm.arch=joint_decoder"))
    names = [n for n, _ in model.named_parameters()]
    check_specs(VLMSettings(freeze=["vision", "layers.1"]), names)
    bad = VLMSettings(freeze_schedule=[{"start_step": 0, "freeze": ["visoin"]}])
    with pytest.raises(InvalidInputError, match=r"vlm.freeze_schedule.0.freeze: 'visoin' matches no parameter"):
        check_specs(bad, names)


def test_freeze_mismatch_names_the_module_and_when() -> None:
    saved = {
        "freeze": ["embeddings"],
        "freeze_schedule": [
            {"start_step": 0, "freeze": ["vision", "adapter"]},
            {"start_step": 5, "freeze": ["vision"]},
            {"start_step": 9, "freeze": []},
        ],
    }
    assert freeze_mismatch(saved, SCHEDULE, 6) is None
    # the past may differ: only the freeze from the resume step on matters
    past = VLMSettings(
        freeze=["embeddings"],
        freeze_schedule=[{"start_step": 5, "freeze": ["vision"]}, {"start_step": 9, "freeze": []}],
    )
    assert freeze_mismatch(saved, past, 6) is None
    now = VLMSettings(freeze=["embeddings"], freeze_schedule=[{"start_step": 0, "freeze": ["vision", "adapter"]}])
    msg = freeze_mismatch(saved, now, 6)
    assert msg is not None and "module adapter frozen in this run but trained in the checkpoint's" in msg
    assert "from the resume step (step=6)" in msg
    later = VLMSettings(
        freeze=["embeddings"],
        freeze_schedule=[
            {"start_step": 0, "freeze": ["vision", "adapter"]},
            {"start_step": 5, "freeze": ["vision"]},
            {"start_step": 12, "freeze": []},
        ],
    )
    msg = freeze_mismatch(saved, later, 6)
    assert msg is not None and "from step 9" in msg and "module vision frozen in this run" in msg


@pytest.mark.parametrize("name", ["adamw", "lion", "muon"])
def test_zero_initial_optimizer_state_trains_exactly_like_lazy_state(name: str) -> None:
    from kforge_cli.engine.train.optim.optimizer import build_optimizer

    s = vlm_settings("--vlm.arch=joint_decoder", f"--optimizer.name={name}")
    losses = []
    for pre_init in (False, True):
        torch.manual_seed(0)
        model = build_vlm(s)
        opt = build_optimizer(model, s.optimizer)
        if pre_init:
            assert init_optimizer_state(opt)
            assert len(opt.state) == len(list(model.parameters()))
            assert not init_optimizer_state(opt)  # only once
        g = torch.Generator().manual_seed(1)
        run = []
        for _ in range(3):
            ids = torch.randint(0, 257, (2, 12), generator=g)
            loss = model(ids, pixel_values=torch.rand(2, 1, 3, 16, 16, generator=g)).logsumexp(-1).mean()
            loss.backward()
            for p in model.vision.parameters():
                p.grad = None  # frozen: never updated
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(loss.item())
        losses.append((run, [p.detach().clone() for p in model.parameters()]))
    (run_a, params_a), (run_b, params_b) = losses
    assert run_a == run_b
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
