"""`kforge plot`: colours per run, eval over train loss, resume markers, SI ticks, --smooth/--log-y/--x/--bits-per-byte.

Runs are metrics.jsonl files written here (the figure's axes are read back); the bytes
per token come from a real `prepare_data` (its recorded ``text_bytes``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kforge_cli.engine.evaluation.bits_per_byte import bytes_per_token
from kforge_cli.engine.observe.curves import ema, load_run, plot_runs, si
from kforge_cli.errors import InvalidInputError


def _train(step: int, loss: float, t: float, tokens_per_step: int = 64) -> dict[str, float]:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 1.0 / step,
        "tokens_seen": tokens_per_step * step,
        "tokens_per_sec": 500.0,
        "step_time_s": 1.0,
        "time": t,
    }


def _run(root: Path, name: str, records: list[dict], data: str | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    config = f'profile = "cpu-debug"\n[data]\npath = "{data}"\n' if data else 'profile = "cpu-debug"\n'
    (run / "config.toml").write_text(config)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _requeued() -> list[dict]:
    """Steps 1..6 at 1 s each from t=1000, killed; an hour later a job resumes from step 4 and logs 5..8 again."""
    first = [_train(s, 5.0 - 0.1 * s, 1000.0 + s) for s in range(1, 7)]
    resumed = {"step": 4, "resumed": True, "time": 5000.0}
    second = [_train(s, 4.0 - 0.1 * s, 5000.0 + (s - 4)) for s in range(5, 9)]
    return [
        *first[:4],
        {"step": 4, "eval_loss": 4.5, "time": 1004.5},
        *first[4:],
        resumed,
        *second,
        {"step": 8, "eval_loss": 3.5},
    ]


def test_one_colour_per_run_eval_over_the_train_loss_and_resume_markers(tmp_path: Path) -> None:
    import matplotlib.image

    a = _run(tmp_path, "a", _requeued())
    b = _run(tmp_path, "b", [_train(s, 6.0 - 0.2 * s, 2000.0 + s) for s in range(1, 9)])
    fig = plot_runs([a, b], tmp_path / "curves.png")
    png = matplotlib.image.imread(tmp_path / "curves.png")
    assert png.shape[:2] == (770, 1000)  # 4 panels: 2 x 2 of 5 x 3.6 inches, and a 0.5 inch legend band
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["loss + eval_loss", "lr", "grad_norm", "tokens_per_sec"]
    colours: dict[str, set] = {"a": set(), "b": set()}
    loss_ax = visible[0]
    train_a, eval_a, train_b = [c for c in loss_ax.get_lines() if c.get_linestyle() in ("-", "--")]
    assert train_b.get_label() == "b" and len(train_b.get_xdata()) == 8
    assert list(train_a.get_xdata()) == [1, 2, 3, 4, 5, 6, 7, 8]  # once per step, in order: one curve
    assert list(train_a.get_ydata())[4:] == pytest.approx([3.5, 3.4, 3.3, 3.2])  # the requeued job's values win
    assert (list(eval_a.get_xdata()), eval_a.get_linestyle()) == ([4, 8], "--")  # dashed, over the loss
    for ax in visible:
        for line in ax.get_lines():
            if line.get_linestyle() == ":":  # the resume marker: run a, at step 4, in every panel
                assert list(line.get_xdata()) == [4, 4]
                colours["a"].add(line.get_color())
            elif line.get_label() in colours:
                colours[str(line.get_label())].add(line.get_color())
    assert len(colours["a"]) == 1 and len(colours["b"]) == 1 and colours["a"] != colours["b"]  # same colour everywhere
    assert sum(line.get_linestyle() == ":" for ax in visible for line in ax.get_lines()) == len(visible)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["a", "b", "eval loss", "resumed"]


def test_time_axis_leaves_out_the_gap_between_jobs_and_tokens_axis_ticks_are_si(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", _requeued())
    run = load_run(a, ["loss", "eval_loss"], "time")
    # job 1: step 1 ends 1 s after its start (t=1000), step 6 at 6 s; job 2 starts at 6 s (its marker),
    # step 5 one second later (the hour between the jobs is not training time)
    assert run.series["loss"].x == pytest.approx([1, 2, 3, 4, 7, 8, 9, 10])
    assert run.resumes == pytest.approx([6.0]) and run.series["eval_loss"].x[0] == pytest.approx(4.5)
    tokens = load_run(a, ["loss", "eval_loss"], "tokens")
    assert tokens.series["eval_loss"].x == [256, 512] and tokens.resumes == [256]  # eval records carry no tokens
    big = _run(tmp_path, "big", [_train(s, 3.0, 1000.0 + s, tokens_per_step=524_288) for s in range(1, 2001, 100)])
    fig = plot_runs([big], tmp_path / "tok.png", metrics=["loss"], x="tokens")
    ax = fig.axes[0]
    labels = [si(v) for v in ax.get_xticks() if ax.get_xlim()[0] <= v <= ax.get_xlim()[1]]
    assert ax.get_xlabel() == "tokens seen" and labels and all(len(label) <= 5 for label in labels), labels
    assert any(label.endswith("M") or label.endswith("B") for label in labels), labels
    assert (si(0), si(750), si(1500), si(2.5e7), si(1.2e9), si(3e-4)) == ("0", "750", "1.5k", "25M", "1.2B", "0.0003")


def test_smooth_and_log_y(tmp_path: Path) -> None:
    assert ema([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    assert ema([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])  # bias-corrected: no pull towards 0
    assert ema([0.0, 10.0], 0.5) == pytest.approx([0.0, 10 * 0.5 / 0.75])
    with pytest.raises(InvalidInputError, match="--smooth 1.0 must be in"):
        ema([1.0], 1.0)
    noisy = [_train(s, 3.0 + (0.5 if s % 2 else -0.5), 1000.0 + s) for s in range(1, 21)]
    a = _run(tmp_path, "a", noisy)
    fig = plot_runs([a], tmp_path / "s.png", metrics=["loss"], smooth=0.8, log_y=True)
    raw, smoothed = fig.axes[0].get_lines()
    assert raw.get_alpha() == 0.25 and smoothed.get_alpha() is None
    spread = max(smoothed.get_ydata()[5:]) - min(smoothed.get_ydata()[5:])
    assert spread < 0.5 * (max(raw.get_ydata()) - min(raw.get_ydata()))
    assert fig.axes[0].get_yscale() == "log"


def test_bits_per_byte_uses_the_bytes_per_token_recorded_at_prepare_time(tmp_path: Path) -> None:
    from kforge_cli.engine.data.prepare.prepare_run import prepare_data

    text = tmp_path / "d.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"héllo wörld {i}"}) for i in range(200)) + "\n")
    data = tmp_path / "data"
    prepare_data([text], data, val_fraction=0.1, workers=1)
    meta = json.loads((data / "metadata.json").read_text())
    texts = [f"héllo wörld {i}" for i in range(200)]
    assert sum(meta["splits"][s]["text_bytes"] for s in ("train", "val")) == sum(len(t.encode()) for t in texts)
    train = meta["splits"]["train"]
    assert train["text_bytes"] == train["tokens"] - train["documents"]  # byte tokenizer: all but the EOS
    run = _run(tmp_path, "r", [_train(s, 2.0, 1000.0 + s) for s in range(1, 4)], data=str(data))
    scale = bytes_per_token(run)
    assert scale["train"] == pytest.approx(train["text_bytes"] / train["tokens"])
    fig = plot_runs([run], tmp_path / "b.png", metrics=["loss"], bytes_per_token=[scale])
    ax = fig.axes[0]
    assert ax.get_title() == "loss (bits per byte)" and ax.get_ylabel() == "bits per byte"
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([2.0 / math.log(2) / scale["train"]] * 3)
    builtin = _run(tmp_path, "builtin", [_train(1, 2.0, 1.0)])
    assert 0.97 < bytes_per_token(builtin)["train"] < 1.0  # byte tokens, less one EOS per story
    old = tmp_path / "old"
    old.mkdir()
    (old / "metadata.json").write_text(json.dumps({"tokenizer": {"kind": "hf"}, "splits": {"train": {"tokens": 9}}}))
    with pytest.raises(InvalidInputError, match=r"does not record its text bytes.*prepare-data"):
        bytes_per_token(_run(tmp_path, "o", [_train(1, 2.0, 1.0)], data=str(old)))


def test_plot_cli_choices_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kforge_cli.cli.app import main

    a = _run(tmp_path, "a", _requeued())
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(a), "--x", "hours"])
    err = " ".join(line.strip(" │") for line in capsys.readouterr().err.splitlines())
    assert exit_info.value.code == 2 and "'hours' is not one of 'step', 'tokens'," in err, err
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(a), "--x", "time", "--smooth", "0.5", "--log-y", "--bits-per-byte", "-o", str(a / "c.png")])
    assert exit_info.value.code == 0 and (a / "c.png").stat().st_size > 10_000
