"""`kforge plan calibrate`: fit the cost model's constants to measured trials.

Input: a trial directory written by `kforge plan trial` (TRIAL_DIR/trials.json and each trial's
profile.toml). The fit evaluates the cost model (the same ``estimate_step`` every `kforge plan`
command prints, slowest pipeline rank) on a grid of ``plan.mfu`` x one collective bandwidth
(``plan.intra_node_gbps`` = ``plan.inter_node_gbps``) x one overlap share (fsdp, tp, cp, ep and pp
alike) x ``plan.full_speed_tokens``; the point with the least mean squared log error of the
predicted against the measured step time wins (``plan.hbm_gbps`` is not fitted: the optimizer
step is a small part). The error is in-sample: with a handful of trials it says how well the
model's *shape* fits, not how well it predicts a new layout. The result is a ``[plan]`` section:
written as a profile that extends the trials' profile (``--output``), or into a profile file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

from kforge_cli.common.json_values import int_of, list_of
from kforge_cli.engine.plan.cost_model import KINDS, CostConstants, cost_constants
from kforge_cli.errors import InvalidInputError

MFUS = [round(0.01 * 1.2**i, 4) for i in range(26)]  # 0.01 .. 0.95
GBPS = [round(0.05 * 1.4**i, 3) for i in range(30)]  # 0.05 .. 870
OVERLAPS = [0.0, 0.25, 0.5, 0.75, 0.9]
FULL_SPEED = [256, 1024, 4096, 16384]
Point = tuple[float, float, float, int]  # mfu, GB/s, overlap, full-speed tokens


class CalibrationRow(TypedDict):
    """One trial of a calibration: its index and layout as trials.json has them, and three step times (s)."""

    trial: object
    layout: object
    measured_s: float
    default_s: float
    fitted_s: float


@dataclass
class Calibration:
    """The fitted constants and each trial's measured, default and fitted step time."""

    trial_dir: str
    profile: str  # what the trials' profiles extend
    gpu_type: str
    world_size: int
    steps: int
    launcher: str
    plan: dict[str, float | int]  # the fitted [plan] section
    rows: list[CalibrationRow] = field(default_factory=list)
    mean_abs_error_default: float = 0.0
    mean_abs_error_fitted: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def _plan_section(point: Point) -> dict[str, float | int]:
    mfu, gbps, overlap, full = point
    out: dict[str, float | int] = {"mfu": mfu, "intra_node_gbps": gbps, "inter_node_gbps": gbps}
    out["full_speed_tokens"] = full
    return out | {f"{kind}_overlap": overlap for kind in KINDS}


def _with(c: CostConstants, point: Point) -> CostConstants:
    mfu, gbps, overlap, full = point
    return replace(
        c,
        mfu=mfu,
        intra_bps=gbps * 1e9,
        inter_bps=gbps * 1e9,
        overlap=dict.fromkeys(KINDS, overlap),
        full_speed_tokens=full,
    )


def _trial_profile(trial_dir: Path, trial: dict[str, object]) -> Path:
    given = Path(str(trial.get("profile", "")))
    if given.is_file():
        return given
    local = trial_dir / f"trial-{trial.get('index')}" / "profile.toml"
    if local.is_file():
        return local
    raise InvalidInputError(f"{trial_dir / 'trials.json'}: trial {trial.get('index')}'s profile {given} is missing")


def _case(trial_dir: Path, trial: dict[str, object]) -> tuple[CostConstants, Callable[[CostConstants], float]]:
    """The trial's default constants and its step time as a function of the constants (the search's memo)."""
    from kforge_cli.engine.parallel.build import compute_dtype
    from kforge_cli.engine.plan.layouts import layout_of
    from kforge_cli.engine.plan.param_shards import build_template
    from kforge_cli.engine.plan.search import _Memo
    from kforge_cli.engine.plan.sharded_model import target_device
    from kforge_cli.engine.runtime.dtypes import dtype_name
    from kforge_cli.settings import load_settings, resolve_dims

    settings = load_settings(profile=str(_trial_profile(trial_dir, trial)), use_env=False).settings
    world = int_of(trial["world_size"])
    dims = resolve_dims(settings, world)
    device = target_device(settings)
    cdtype = compute_dtype(settings, device)
    memo = _Memo(settings, build_template(settings), cdtype.itemsize, device.type == "cuda")
    layout = layout_of(settings, dims)
    return cost_constants(settings, dtype_name(cdtype)), lambda c: memo.estimate(settings, layout, dims, c).step_s


def read_trials(trial_dir: Path) -> dict[str, object]:
    path = Path(trial_dir) / "trials.json"
    if not path.is_file():
        raise InvalidInputError(f"{path} does not exist: give a directory `kforge plan trial` wrote (--trial-dir)")
    from kforge_cli.common.files import read_text_capped

    try:
        summary = json.loads(read_text_capped(path, 16 * 2**20))
    except ValueError as exc:
        raise InvalidInputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("trials"), list):
        raise InvalidInputError(f"{path}: no 'trials' list")
    return summary


def calibrate(trial_dir: Path) -> Calibration:
    """Fit the constants to the finished trials of ``trial_dir`` (module docstring)."""
    trial_dir = Path(trial_dir)
    summary = read_trials(trial_dir)
    trials = [t for t in list_of(summary["trials"]) if isinstance(t, dict) and t.get("measured_step_s")]
    if not trials:
        raise InvalidInputError(f"{trial_dir / 'trials.json'}: no trial finished: nothing to fit")
    cases = [_case(trial_dir, t) for t in trials]
    measured = [float(t["measured_step_s"]) for t in trials]

    def loss(point: Point) -> float:
        pred = [step(_with(c, point)) for c, step in cases]
        return sum(math.log(p / m) ** 2 for p, m in zip(pred, measured, strict=True)) / len(pred)

    best: tuple[float, Point] = (math.inf, (0.0, 0.0, 0.0, 0))
    for mfu in MFUS:
        for gbps in GBPS:
            for overlap in OVERLAPS:
                for full in FULL_SPEED:
                    value = loss((mfu, gbps, overlap, full))
                    if value < best[0]:
                        best = (value, (mfu, gbps, overlap, full))
    default = [step(c) for c, step in cases]
    fitted = [step(_with(c, best[1])) for c, step in cases]
    rows: list[CalibrationRow] = [
        {"trial": t["index"], "layout": t["layout"], "measured_s": m, "default_s": d, "fitted_s": f}
        for t, m, d, f in zip(trials, measured, default, fitted, strict=True)
    ]
    first_profile = _trial_profile(trial_dir, trials[0])
    return Calibration(
        trial_dir=str(trial_dir),
        profile=str(summary.get("profile") or _extends_of(first_profile)),
        gpu_type=str(summary.get("gpu_type", "")),
        world_size=int_of(summary.get("world_size", 0)),
        steps=int_of(summary.get("steps", 0)),
        launcher=str(summary.get("launcher", "")),
        plan=_plan_section(best[1]),
        rows=rows,
        mean_abs_error_default=sum(abs(d / m - 1) for d, m in zip(default, measured, strict=True)) / len(rows),
        mean_abs_error_fitted=sum(abs(f / m - 1) for f, m in zip(fitted, measured, strict=True)) / len(rows),
    )


def _extends_of(profile: Path) -> str:
    from kforge_cli.common.files import read_toml_file

    parent = read_toml_file(profile, "profile").get("extends")
    return str(parent) if isinstance(parent, str) else ""


def format_calibration(c: Calibration) -> str:
    lines = [
        f"calibration: {c.gpu_type} x {c.world_size}, {c.steps} steps per trial ({c.launcher}), from {c.trial_dir}",
        f"  {'#':>2} {'measured':>9} {'default':>9} {'error':>7} {'fitted':>9} {'error':>7}  layout",
    ]
    for r in c.rows:
        m, d, f = r["measured_s"], r["default_s"], r["fitted_s"]
        lines.append(
            f"  {r['trial']:>2} {m:>8.4g}s {d:>8.4g}s {d / m - 1:>+7.0%} {f:>8.4g}s {f / m - 1:>+7.0%}  {r['layout']}"
        )
    lines.append(
        f"  mean |error|: defaults {c.mean_abs_error_default:.0%}, fitted {c.mean_abs_error_fitted:.0%} (in-sample)"
    )
    return "\n".join(lines)


def plan_toml(c: Calibration) -> str:
    """The fitted ``[plan]`` section as TOML."""
    import tomli_w

    return tomli_w.dumps({"plan": c.plan})


def fragment_toml(c: Calibration) -> str:
    """A profile that extends the trials' profile with the fitted ``[plan]`` (a profile can extend it in turn)."""
    import tomli_w

    head = (
        f"# Written by `kforge plan calibrate` from {c.trial_dir} ({len(c.rows)} trials; in-sample mean |error| "
        f"{c.mean_abs_error_fitted:.0%}).\n"
    )
    body: dict[str, object] = {"description": f"{c.profile} with the cost model fitted to {c.trial_dir}"}
    if c.profile:
        body["extends"] = c.profile
    return head + tomli_w.dumps({**body, "plan": c.plan})


def with_plan_section(profile_text: str, c: Calibration) -> str:
    """``profile_text`` (a profile file) with its ``[plan]`` section replaced by the fitted one."""
    import tomllib

    import tomli_w

    data = tomllib.loads(profile_text)
    data["plan"] = {**(data.get("plan") or {}), **c.plan}
    lines = profile_text.splitlines()
    leading = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    comments = "".join(line + "\n" for line in lines[:leading])  # the file's head comment; TOML drops the rest
    head = comments + f"# [plan] fitted by `kforge plan calibrate` from {c.trial_dir}.\n"
    return head + tomli_w.dumps(data)
