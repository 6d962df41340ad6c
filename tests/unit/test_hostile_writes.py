"""Every file kforge writes goes through the no-follow, unique-temp atomic write (issue 29, class 3).

Planted links in a run directory or an output path: at a fixed temporary name the old code
used (``tokenizer.json.tmp``, ``.NAME.tmpPID``), at the output itself (``curves.png``), or
as a directory a library writes into (``RUN/wandb``, ``RUN/tensorboard``). Nothing is ever
written through them; the file kforge meant to write is a regular file with the right bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kforge_cli.common.files import atomic_write
from kforge_cli.errors import KforgeError

SECRET = "ssh-ed25519 AAAA... precious\n"


@pytest.fixture
def target(tmp_path: Path) -> Path:
    t = tmp_path / "outside" / "authorized_keys"
    t.parent.mkdir()
    t.write_text(SECRET)
    return t


def plant_temp_names(path: Path, target: Path) -> None:
    """Links at every temporary name a writer of `path` could predict."""
    for name in (f"{path.name}.tmp", f".{path.name}.tmp{os.getpid()}", f".{path.name}.tmp", f"{path.stem}.json.tmp"):
        link = path.with_name(name)
        if not link.is_symlink():
            os.symlink(target, link)


def test_atomic_write_uses_a_fresh_unpredictable_temporary_name(
    tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    plant_temp_names(path, target)
    renamed: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(Path(a).name), real_replace(a, b))[-1])
    for i in range(2):
        atomic_write(path, f"{i}".encode())
    assert path.read_text() == "1" and not path.is_symlink() and target.read_text() == SECRET
    assert len(set(renamed)) == 2  # two writes, two names
    assert not any(n.endswith(f".tmp{os.getpid()}") for n in renamed)  # not a name derived from the pid alone
    os.symlink(target, tmp_path / "linked.json")  # a link at the destination is replaced, not followed
    atomic_write(tmp_path / "linked.json", b"{}")
    assert not (tmp_path / "linked.json").is_symlink() and target.read_text() == SECRET


def _bpe(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, the cat sat on the mat"] * 20, trainer)
    tok.save(str(tmp_path / "bpe.json"))
    return tmp_path / "bpe.json"


def test_training_copies_the_tokenizer_without_following_a_planted_temp_link(tmp_path: Path, target: Path) -> None:
    from kforge_cli.engine.data.prepare import prepare_data
    from kforge_cli.engine.data.run_tokenizer import record_run_tokenizer
    from kforge_cli.settings.data import DataSettings

    src = tmp_path / "corpus.txt"
    src.write_text("hello world, the cat sat on the mat\n" * 50)
    prepare_data([src], tmp_path / "data", tokenizer=str(_bpe(tmp_path)), val_fraction=0.2, workers=1)
    run = tmp_path / "run"
    run.mkdir()
    plant_temp_names(run / "tokenizer.json", target)
    record_run_tokenizer(DataSettings(path=str(tmp_path / "data")), run)
    copied = run / "tokenizer.json"
    assert target.read_text() == SECRET
    assert not copied.is_symlink() and copied.read_bytes() == (tmp_path / "data" / "tokenizer.json").read_bytes()


def _metrics_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "time": 1.0 + s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_replaces_a_planted_output_link_instead_of_writing_through_it(tmp_path: Path, target: Path) -> None:
    from kforge_cli.engine.observe.curves import plot_runs

    run = _metrics_run(tmp_path)
    out = tmp_path / "curves.png"
    os.symlink(target, out)
    plant_temp_names(out, target)
    plot_runs([run], out, ["loss", "lr"])
    assert target.read_text() == SECRET
    assert not out.is_symlink() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _info(run: Path) -> Any:
    from kforge_cli.engine.observe.tracking_types import RunInfo

    return RunInfo("r", [], None, 1, None, run, {}, run / "config.toml")


def test_a_planted_wandb_directory_link_is_refused(
    tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kforge_cli.engine.observe.wandb_backend import WandbBackend
    from kforge_cli.settings.infrastructure import MetricsSettings

    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = target.parent / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "wandb")
    backend = WandbBackend(MetricsSettings(backends=["jsonl", "wandb"], wandb_mode="offline"), _info(run))
    try:
        with pytest.raises(KforgeError, match=r"wandb: this directory is a symbolic link") as err:
            backend.start()
        assert err.value.exit_code == 2
    finally:
        if backend._run is not None:  # the old code started a run (in the link's target): end it
            backend._run.finish()
    assert list(elsewhere.iterdir()) == []


def test_a_tensorboard_link_planted_after_start_is_refused(tmp_path: Path, target: Path) -> None:
    pytest.importorskip("tensorboard")
    from kforge_cli.engine.observe.tensorboard_backend import TensorboardBackend
    from kforge_cli.engine.observe.tracking_types import MetricPoints

    run = tmp_path / "run"
    run.mkdir()
    backend = TensorboardBackend(_info(run))
    backend.start()
    elsewhere = target.parent / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "tensorboard")
    with pytest.raises(KforgeError, match=r"tensorboard: this directory is a symbolic link"):
        backend.log_metrics([MetricPoints(step=1, time=1.0, values={"loss": 1.0})])
    backend.finish("completed")
    assert list(elsewhere.iterdir()) == []
