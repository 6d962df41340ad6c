"""LR schedules: known values of every shape, data phases, and the LR each optimizer update sees."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kforge_cli.engine.train.optim.scheduler import build_scheduler, lr_multiplier, phase_lr_scale
from kforge_cli.errors import ConfigError
from kforge_cli.settings import JobSettings, load_settings
from kforge_cli.settings.data import DataPhase
from kforge_cli.settings.training import SchedulerSettings

TOL = 1e-9


def sched(**kwargs: object) -> SchedulerSettings:
    return SchedulerSettings(**kwargs)  # type: ignore[arg-type]


def test_warmup_starts_above_zero_and_reaches_peak_on_its_last_step() -> None:
    s = sched(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_multiplier(k, s, 100) for k in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=TOL)


def test_cosine_peak_midpoint_and_end() -> None:
    s = sched(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    max_steps = 110  # decay over 100 steps after warmup
    assert lr_multiplier(10, s, max_steps) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(60, s, max_steps) == pytest.approx((1 + 0.1) / 2, abs=TOL)
    assert lr_multiplier(110, s, max_steps) == pytest.approx(0.1, abs=TOL)
    assert lr_multiplier(500, s, max_steps) == pytest.approx(0.1, abs=TOL)  # clipped past the end
    assert lr_multiplier(35, s, max_steps) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), abs=TOL)


def test_explicit_decay_steps_end_earlier() -> None:
    s = sched(name="cosine", warmup_steps=0, decay_steps=20, min_lr_ratio=0.0)
    assert lr_multiplier(10, s, 1000) == pytest.approx(0.5, abs=TOL)
    assert lr_multiplier(20, s, 1000) == pytest.approx(0.0, abs=TOL)
    assert lr_multiplier(900, s, 1000) == pytest.approx(0.0, abs=TOL)


def test_linear() -> None:
    s = sched(name="linear", warmup_steps=0, min_lr_ratio=0.2)
    assert lr_multiplier(0, s, 100) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(25, s, 100) == pytest.approx(1 - 0.25 * 0.8, abs=TOL)
    assert lr_multiplier(50, s, 100) == pytest.approx(0.6, abs=TOL)
    assert lr_multiplier(100, s, 100) == pytest.approx(0.2, abs=TOL)


def test_rex() -> None:
    s = sched(name="rex", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(0, s, 100) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(50, s, 100) == pytest.approx(0.5 / 0.75, abs=TOL)
    assert lr_multiplier(100, s, 100) == pytest.approx(0.0, abs=TOL)
    s_min = sched(name="rex", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_multiplier(50, s_min, 100) == pytest.approx(0.1 + 0.9 * 0.5 / 0.75, abs=TOL)


def test_constant_after_warmup() -> None:
    s = sched(name="constant", warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_multiplier(k, s, 10) for k in (0, 1, 2, 9, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0], abs=TOL)


@pytest.mark.parametrize(
    ("shape", "midpoint"),
    [
        ("linear", 1 - 0.5 * 0.9),
        ("cosine", 0.1 + 0.9 * 0.5),
        ("sqrt", 1 - math.sqrt(0.5) * 0.9),
    ],
)
def test_wsd_stable_then_cooldown(shape: str, midpoint: float) -> None:
    s = sched(name="wsd", warmup_steps=10, decay_steps=20, min_lr_ratio=0.1, wsd_cooldown=shape)
    max_steps = 100  # stable until 80, cooldown 80..100
    assert lr_multiplier(10, s, max_steps) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(79, s, max_steps) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(80, s, max_steps) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(90, s, max_steps) == pytest.approx(midpoint, abs=TOL)
    assert lr_multiplier(100, s, max_steps) == pytest.approx(0.1, abs=TOL)


def test_wsd_default_cooldown_is_twenty_percent() -> None:
    s = sched(name="wsd", warmup_steps=0, decay_steps=None, min_lr_ratio=0.0, wsd_cooldown="linear")
    assert lr_multiplier(799, s, 1000) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(900, s, 1000) == pytest.approx(0.5, abs=TOL)


def test_phase_lr_scale() -> None:
    phases = [DataPhase(start_step=10, lr_scale=0.5), DataPhase(start_step=20, lr_scale=0.25)]
    assert phase_lr_scale(0, phases) == 1.0
    assert phase_lr_scale(9, phases) == 1.0
    assert phase_lr_scale(10, phases) == 0.5
    assert phase_lr_scale(19, phases) == 0.5
    assert phase_lr_scale(20, phases) == 0.25
    assert phase_lr_scale(10_000, phases) == 0.25
    assert phase_lr_scale(5, []) == 1.0


def _settings(**scheduler: object) -> JobSettings:
    return JobSettings(
        train={"max_steps": 12},
        scheduler=scheduler,
        data={"phases": [{"start_step": 8, "lr_scale": 0.5}]},
    )


def test_lr_seen_by_each_update_equals_the_formula() -> None:
    """Loop usage: optimizer.step() then scheduler.step(); update k must use lr * mult(k) * phase(k)."""
    settings = _settings(name="cosine", warmup_steps=3, min_lr_ratio=0.1)
    param = torch.nn.Parameter(torch.zeros(1))
    other = torch.nn.Parameter(torch.zeros(1))
    # SGD without momentum: the parameter moves by exactly -lr * grad, so we read back the LR used.
    optimizer = torch.optim.SGD([{"params": [param], "lr": 0.1}, {"params": [other], "lr": 0.02}])
    scheduler = build_scheduler(optimizer, settings.scheduler, settings.train.max_steps, settings.data.phases)
    for k in range(12):
        before, before_other = param.item(), other.item()
        param.grad = torch.ones(1)
        other.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
        expected = lr_multiplier(k, settings.scheduler, 12) * phase_lr_scale(k, settings.data.phases)
        assert before - param.item() == pytest.approx(0.1 * expected, rel=1e-5)
        assert before_other - other.item() == pytest.approx(0.02 * expected, rel=1e-5)
    assert expected == pytest.approx(0.5 * lr_multiplier(11, settings.scheduler, 12), abs=TOL)


def test_state_dict_is_json_and_resumes_at_the_same_lr() -> None:
    settings = _settings(name="linear", warmup_steps=2, min_lr_ratio=0.0)
    opt_a = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched_a = build_scheduler(opt_a, settings.scheduler, settings.train.max_steps, settings.data.phases)
    for _ in range(5):
        opt_a.step()
        sched_a.step()
    text = json.dumps(sched_a.state_dict())
    opt_b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched_b = build_scheduler(opt_b, settings.scheduler, settings.train.max_steps, settings.data.phases)
    sched_b.load_state_dict(json.loads(text))
    opt_b.load_state_dict(opt_a.state_dict())
    assert opt_b.param_groups[0]["lr"] == pytest.approx(lr_multiplier(5, settings.scheduler, 12), abs=TOL)
    sched_b.step()
    assert opt_b.param_groups[0]["lr"] == pytest.approx(lr_multiplier(6, settings.scheduler, 12), abs=TOL)


def test_negative_decay_steps_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="scheduler.decay_steps"):
        load_settings(overrides=["--scheduler.decay_steps=-1"], use_env=False)
    settings = JobSettings()
    settings.scheduler = SchedulerSettings.model_construct(decay_steps=-1)  # built in code, unvalidated
    with pytest.raises(ConfigError, match="scheduler.decay_steps"):
        build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), settings.scheduler, 10)
