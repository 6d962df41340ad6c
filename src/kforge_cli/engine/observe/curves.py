"""Training curves from run directories' ``metrics.jsonl`` (offline, after a requeue too), as one PNG.

A requeued job resumes from its last checkpoint and logs the steps after it again, so
a step can appear twice; the last record of each step wins, which makes the curve the
one continuous run the checkpoint saw. One panel per metric, one line per run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kforge_cli.engine.observe.metrics_file import count_lines, iter_metrics, sample_records
from kforge_cli.errors import InvalidInputError
from kforge_cli.files import atomic_write_via

DEFAULT_METRICS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_sec")
X_AXES = {"step": "step", "tokens": "tokens_seen"}


@dataclass
class Series:
    run: str
    metric: str
    x: list[float]
    y: list[float]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def last_per_step(records: Sequence[dict[str, Any]], metric: str) -> dict[int, float]:
    """``step -> value`` of `metric`, the last record of a step winning (requeues repeat steps)."""
    out: dict[int, float] = {}
    for record in records:
        step, value = record.get("step"), _number(record.get(metric))
        if isinstance(step, int) and value is not None:
            out[step] = value
    return dict(sorted(out.items()))


MAX_POINTS = 20_000  # per curve: more than a PNG panel can show; longer runs are drawn from every k-th step
FULL_READ_BYTES = 16 << 20  # a larger metrics.jsonl is sampled by byte offset instead of read whole


def _sampled_records(path: Path, wanted: Sequence[str]) -> list[dict[str, Any]]:
    """The records of `path` reduced to step + `wanted` keys, at most about ``MAX_POINTS`` of them.

    Up to ``FULL_READ_BYTES`` the file is streamed and every k-th step kept (requeued steps:
    the last record wins); a larger file is sampled at ``MAX_POINTS`` byte offsets, so time and
    memory follow the plot, not the file. The last record always stays (the curve ends where
    the run is).
    """
    size = path.stat().st_size
    if size > FULL_READ_BYTES:
        records: Iterable[dict[str, Any]] = sample_records(path, MAX_POINTS)
        stride = 1
    else:
        records = iter_metrics(path)
        stride = max(1, math.ceil(count_lines(path) / MAX_POINTS))
    keep: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        slim = {k: record[k] for k in wanted if k in record}
        slim["step"] = step
        last = slim
        if step % stride == 0:
            keep.append(slim)
    if last is not None and (not keep or keep[-1] is not last):
        keep.append(last)
    return keep


def run_series(run_dir: Path, metrics: Sequence[str], x: str = "step") -> list[Series]:
    """One series per metric present in `run_dir`'s metrics.jsonl, against step or tokens seen."""
    if x not in X_AXES:
        raise InvalidInputError(f"--x {x!r} is not one of {', '.join(X_AXES)}")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise InvalidInputError(f"{run_dir} has no metrics.jsonl: is it a kforge run directory?")
    records = _sampled_records(path, [*metrics, "tokens_seen"])
    tokens = last_per_step(records, "tokens_seen")
    out = []
    for metric in metrics:
        points = last_per_step(records, metric)
        if x == "tokens":
            points = {s: v for s, v in points.items() if s in tokens}
            xs = [tokens[s] for s in points]
        else:
            xs = [float(s) for s in points]
        if points:
            out.append(Series(run_dir.name, metric, xs, list(points.values())))
    return out


def plot_runs(run_dirs: Sequence[Path], out: Path, metrics: Sequence[str] = DEFAULT_METRICS, x: str = "step") -> Any:
    """Write the PNG; returns the matplotlib Figure (tests read its axes)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    series = [s for run in run_dirs for s in run_series(Path(run), metrics, x)]
    shown = [m for m in metrics if any(s.metric == m for s in series)]
    if not shown:
        raise InvalidInputError(f"none of {', '.join(metrics)} is logged in {', '.join(map(str, run_dirs))}")
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, shown, strict=False):
        for s in (s for s in series if s.metric == metric):
            ax.plot(s.x, s.y, label=s.run, marker="." if len(s.x) < 30 else None)
        ax.set_title(metric)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        if metric in ("loss", "eval_loss") or metric.startswith("loss/"):
            ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        if len(run_dirs) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # a planted link at `out` is replaced, never written through
        atomic_write_via(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return fig
