"""Training curves from run directories' ``metrics.jsonl`` (offline, after a requeue too), as one PNG.

A requeued job resumes from its last checkpoint and logs the steps after it again, so
a step can appear twice; the last record of each step wins, which makes the curve the
one continuous run the checkpoint saw. Each job that resumed wrote a ``{"step", "resumed"}``
record when it started: a dotted vertical line in the run's colour marks it in every panel.

One panel per metric, one colour per run in every panel; the eval loss is drawn over the
training loss (dashed, dots). ``x`` is the step, the tokens seen, or the training wall-clock
time (the gaps between a stopped job and its resumption left out). ``smooth`` is an
exponential moving average (TensorBoard's, bias-corrected) of the training curves, the raw
values shown faintly behind. Given each run's bytes per token (engine.inference.bits_per_byte,
from the ``text_bytes`` that ``kforge prepare-data`` records per split), losses are drawn in
bits per UTF-8 byte of text, so runs with different tokenizers compare.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import atomic_write_via
from kforge_cli.engine.observe.metrics_file import count_lines, iter_metrics, sample_records
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.layout import RunDir

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_METRICS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_sec")
X_AXES = ("step", "tokens", "time")
RESUMED = "resumed"  # the marker record's key: {"step": N, "resumed": true, "time": ...}
LN2 = math.log(2)
_SI = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))  # B: billions, as tokens and parameters are counted


@dataclass
class Series:
    run: str
    metric: str
    x: list[float]
    y: list[float]


@dataclass
class RunCurves:
    """One run's series against the chosen x axis, and where its resumed jobs started."""

    name: str
    series: dict[str, Series]
    resumes: list[float] = field(default_factory=list)


def si(value: float, _pos: object = None) -> str:
    """A short tick label: ``0``, ``750``, ``1.5k``, ``20M``, ``1.2B`` (also negative and small values)."""
    if value == 0:
        return "0"
    for scale, unit in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float: not a value to draw
        return None
    return number if math.isfinite(number) else None


def last_per_step(records: Sequence[dict[str, object]], metric: str) -> dict[int, float]:
    """``step -> value`` of `metric`, the last record of a step winning (requeues repeat steps)."""
    out: dict[int, float] = {}
    for record in records:
        step, value = record.get("step"), _number(record.get(metric))
        if isinstance(step, int) and value is not None:
            out[step] = value
    return dict(sorted(out.items()))


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, bias-corrected (the start is not pulled to 0)."""
    if not 0 <= weight < 1:
        raise InvalidInputError(f"--smooth {weight} must be in [0, 1) (0 = off, 0.9 = strong)")
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**i) if weight else v)
    return out


MAX_POINTS = 20_000  # per curve: more than a PNG panel can show; longer runs are drawn from every k-th step
FULL_READ_BYTES = 16 << 20  # a larger metrics.jsonl is sampled by byte offset instead of read whole


def _sampled_records(path: Path, wanted: Sequence[str]) -> list[dict[str, object]]:
    """The records of `path` reduced to step + `wanted` keys, at most about ``MAX_POINTS`` of them.

    Up to ``FULL_READ_BYTES`` the file is streamed and every k-th step kept (requeued steps:
    the last record wins; a job's resume marker always stays); a larger file is sampled at ``MAX_POINTS`` byte offsets, so time and
    memory follow the plot, not the file. The last record always stays (the curve ends where
    the run is).
    """
    size = path.stat().st_size
    if size > FULL_READ_BYTES:
        records: Iterable[dict[str, object]] = sample_records(path, MAX_POINTS)
        stride = 1
    else:
        records = iter_metrics(path)
        stride = max(1, math.ceil(count_lines(path) / MAX_POINTS))
    keep: list[dict[str, object]] = []
    last: dict[str, object] | None = None
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        slim = {k: record[k] for k in wanted if k in record}
        slim["step"] = step
        last = slim
        if step % stride == 0 or record.get(RESUMED):  # a job's start marks the curve and the clock
            keep.append(slim)
    if last is not None and (not keep or keep[-1] is not last):
        keep.append(last)
    return keep


def _tokens_at(records: Sequence[dict[str, object]]) -> Callable[[int], float | None]:
    """``step -> tokens seen``: exact at logged steps, else the step times the tokens per step
    of the nearest logged step before it (eval records carry no token count)."""
    known = last_per_step(records, "tokens_seen")
    steps = sorted(known)

    def at(step: int) -> float | None:
        if step in known:
            return known[step]
        before = [s for s in steps if s <= step] or steps[:1]
        return step * known[before[-1]] / before[-1] if before and before[-1] > 0 else None

    return at


def _elapsed(records: Sequence[dict[str, object]]) -> list[float | None]:
    """Per record, seconds of training when it was written: wall-clock time since the run started,
    less the gaps between jobs (each resumed job continues the clock where the previous one stopped)."""
    out: list[float | None] = []
    offset = start = None
    last_seen = 0.0
    for record in records:
        t = _number(record.get("time"))
        if t is None:
            out.append(None)
            continue
        if start is None or record.get(RESUMED):
            offset = last_seen
            first_step = 0.0 if record.get(RESUMED) else (_number(record.get("step_time_s")) or 0.0)
            start = t - first_step  # a job's clock starts before its first step, not when that step is logged
        assert offset is not None
        last_seen = max(last_seen, offset + max(t - start, 0.0))
        out.append(last_seen)
    return out


def _last_records(records: Sequence[dict[str, object]], metric: str) -> dict[int, tuple[float, int]]:
    """``step -> (value, index of its record)``, the last record of a step winning."""
    out: dict[int, tuple[float, int]] = {}
    for i, record in enumerate(records):
        step, value = record.get("step"), _number(record.get(metric))
        if isinstance(step, int) and value is not None:
            out[step] = (value, i)
    return dict(sorted(out.items()))


def load_run(
    run_dir: Path,
    metrics: Sequence[str],
    x: str = "step",
    *,
    scale: Mapping[str, float] | None = None,
) -> RunCurves:
    """A run's series for `metrics` present in its metrics.jsonl, against step, tokens or time.

    ``scale`` (bytes per token by split, see engine.inference.bits_per_byte) turns losses into
    bits per byte."""
    if x not in X_AXES:
        raise InvalidInputError(f"--x {x!r} is not one of {', '.join(X_AXES)}")
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise InvalidInputError(f"{run_dir} has no metrics.jsonl: is it a kforge run directory?")
    records = _sampled_records(path, [*metrics, "tokens_seen", "time", "step_time_s", RESUMED])
    tokens_at = _tokens_at(records)
    elapsed = _elapsed(records) if x == "time" else []

    def x_of(step: int, index: int) -> float | None:
        if x == "tokens":
            return tokens_at(step)
        if x == "time":
            return elapsed[index]
        return float(step)

    series: dict[str, Series] = {}
    for metric in metrics:
        xs, ys = [], []
        for step, (value, index) in _last_records(records, metric).items():
            pos = x_of(step, index)
            if pos is not None:
                xs.append(pos)
                ys.append(value / LN2 / scale[_split_of(metric, scale)] if scale and is_loss(metric) else value)
        if xs:
            series[metric] = Series(run_dir.name, metric, xs, ys)
    marks = [x_of(step, i) for i, r in enumerate(records) if r.get(RESUMED) and isinstance(step := r.get("step"), int)]
    return RunCurves(run_dir.name, series, [m for m in marks if m is not None])


def is_loss(metric: str) -> bool:
    return metric in ("loss", "eval_loss") or metric.startswith(("loss/", "eval_loss/"))


def _split_of(metric: str, scale: Mapping[str, float]) -> str:
    """Which bytes-per-token a loss uses: the val split's for eval losses, a dataset's own for ``loss/NAME``."""
    if metric.startswith("eval_loss"):
        return "val"
    name = metric.partition("/")[2]
    return f"train/{name}" if name and f"train/{name}" in scale else "train"


# ---- drawing --------------------------------------------------------------------------------


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "hours"
    if seconds >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _panels(metrics: Sequence[str], present: set[str]) -> list[list[str]]:
    """Metrics per panel: the eval loss joins the training loss's panel when both are drawn."""
    panels: list[list[str]] = []
    overlay = "loss" in metrics and "eval_loss" in metrics and "loss" in present
    for m in metrics:
        if m not in present or (overlay and m == "eval_loss"):
            continue
        panels.append(["loss", "eval_loss"] if overlay and m == "loss" else [m])
    return panels


def plot_runs(
    run_dirs: Sequence[Path],
    out: Path,
    metrics: Sequence[str] = DEFAULT_METRICS,
    x: str = "step",
    *,
    smooth: float = 0.0,
    log_y: bool = False,
    bytes_per_token: Sequence[Mapping[str, float]] | None = None,
) -> Figure:
    """Write the PNG; returns the matplotlib Figure (tests read its axes).

    ``bytes_per_token``: one mapping per run (engine.inference.bits_per_byte) to draw losses in
    bits per byte; None draws them in nats per token."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    ema([], smooth)  # checks the weight before any file is read
    scales = list(bytes_per_token) if bytes_per_token is not None else [None] * len(run_dirs)
    runs = [load_run(Path(r), metrics, x, scale=sc) for r, sc in zip(run_dirs, scales, strict=True)]
    bits_per_byte = bytes_per_token is not None
    present = {m for r in runs for m in r.series}
    panels = _panels(metrics, present)
    if not panels:
        raise InvalidInputError(f"none of {', '.join(metrics)} is logged in {', '.join(map(str, run_dirs))}")
    colors = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    color = {i: colors[i % len(colors)] for i in range(len(runs))}
    time_scale, time_label = 1.0, "seconds"
    if x == "time":
        longest = max((max(s.x) for r in runs for s in r.series.values()), default=0.0)
        time_scale, time_label = _time_unit(longest)
    x_label = {"step": "step", "tokens": "tokens seen", "time": f"training time ({time_label})"}[x]

    cols = 2 if len(panels) in (2, 4) else min(3, len(panels))  # 4 panels: 2 x 2, not 3 + 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows + 0.5), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for i, run in enumerate(runs):
            for metric in panel:
                s = run.series.get(metric)
                if s is None:
                    continue
                xs = [v / time_scale for v in s.x] if x == "time" else s.x
                if metric.startswith("eval_loss") and panel != [metric]:  # overlaid on the training loss
                    ax.plot(xs, s.y, color=color[i], linestyle="--", marker="o", markersize=3.5, linewidth=1.2)
                    continue
                smoothed = smooth > 0 and not metric.startswith(("eval_loss", "lr")) and len(s.y) > 2
                if smoothed:
                    ax.plot(xs, s.y, color=color[i], alpha=0.25, linewidth=0.8)
                ys = ema(s.y, smooth) if smoothed else s.y
                marker = "." if len(xs) < 30 and not smoothed else None
                if metric.startswith("eval_loss"):
                    marker = "o"
                ax.plot(xs, ys, color=color[i], label=run.name, marker=marker, markersize=3.5, linewidth=1.4)
            for mark in run.resumes:
                ax.axvline(mark / time_scale if x == "time" else mark, color=color[i], linestyle=":", linewidth=1.2)
        title = " + ".join(panel) if len(panel) > 1 else panel[0]
        loss_panel = any(is_loss(m) for m in panel)
        if bits_per_byte and loss_panel:
            title += " (bits per byte)"
        ax.set_title(title)
        ax.set_xlabel(x_label)
        if loss_panel:
            ax.set_ylabel("bits per byte" if bits_per_byte else "loss (nats per token)")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5 if cols > 1 else 8))
        ax.xaxis.set_major_formatter(FuncFormatter(si))
        values = [v for r in runs for m in panel if m in r.series for v in r.series[m].y]
        if log_y and values and min(values) > 0:
            ax.set_yscale("log")
            # within a decade the minor ticks carry the labels (3, 4, 6 rather than 3 x 10^0); across decades
            # only the powers of ten do
            ax.yaxis.set_minor_formatter(FuncFormatter(si) if max(values) < 10 * min(values) else NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(si))
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=color[i], linewidth=2, label=r.name) for i, r in enumerate(runs)]
    if "eval_loss" in present and any(len(p) > 1 for p in panels):
        handles.append(Line2D([], [], color="0.3", linestyle="--", marker="o", markersize=3.5, label="eval loss"))
    if any(r.resumes for r in runs):
        handles.append(Line2D([], [], color="0.3", linestyle=":", label="resumed"))
    notes = [f"smoothed (EMA {smooth:g})"] if smooth else []
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), frameon=False, fontsize="small")
    if notes:
        fig.text(0.995, 0.995, "; ".join(notes), ha="right", va="top", fontsize="x-small", color="0.4")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # a planted link at `out` is replaced, never written through
        atomic_write_via(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return fig
