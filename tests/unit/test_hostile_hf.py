"""Hangs and silent wrong results (issue 29, class 8).

A Hugging Face directory gets the rule DCP metadata already has: the index's weight_map
names plain files inside the model directory (no ``../``), regular files (a FIFO would
hang), links staying inside (a hub cache snapshot's ``../../blobs`` included); config.json
shapes must equal the weights' exactly (no broadcasting copy). A prepared directory's
cached max_id is verified as batches are read; a missing tokenizer is an error, not the
byte tokenizer; a FIFO anywhere `kforge runs` reads does not hang it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kforge_cli
from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.engine.interop.load_model import load_model
from kforge_cli.errors import InvalidInputError
from tests.unit.test_checkpoint_hostile import saved

SRC = Path(kforge_cli.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An honest export in several files with an index (max shard: a few KB)."""
    root = tmp_path_factory.mktemp("hf")
    step = saved(root / "run")[0]
    out = root / "hf"
    export_hf(step, out, max_shard_bytes=20_000, tokenizer="none")
    assert (out / "model.safetensors.index.json").is_file()
    return out


def copy_of(hf: Path, dest: Path) -> Path:
    return Path(shutil.copytree(hf, dest / "model"))


def edit_index(hf: Path, edit: object) -> None:
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit(index["weight_map"])  # type: ignore[operator]
    index_path.write_text(json.dumps(index))


def test_index_names_outside_the_directory_are_refused(hf_sharded: Path, tmp_path: Path) -> None:
    hf = copy_of(hf_sharded, tmp_path)
    first = sorted(p.name for p in hf.glob("*.safetensors"))[0]
    shutil.copy(hf / first, tmp_path / "outside.safetensors")
    edit_index(hf, lambda m: m.update({k: "../outside.safetensors" for k, v in m.items() if v == first}))
    with pytest.raises(CheckpointError, match=r"names '\.\./outside\.safetensors' as a weight file"):
        load_model(hf)


def test_a_weight_file_linked_outside_the_directory_is_refused(hf_sharded: Path, tmp_path: Path) -> None:
    hf = copy_of(hf_sharded, tmp_path)
    first = sorted(p.name for p in hf.glob("*.safetensors"))[0]
    (hf / first).rename(tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", hf / first)
    with pytest.raises(CheckpointError, match=r"is a link to .*elsewhere\.safetensors, outside the model directory"):
        load_model(hf)


def test_a_hub_cache_snapshot_linking_into_its_blob_store_loads(hf_sharded: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(hf_sharded.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        os.symlink(Path("../../blobs") / f"blob{i}", snap / f.name)
    assert load_model(snap).cfg.vocab_size == 64


def test_a_fifo_weight_file_is_refused_not_read(hf_sharded: Path, tmp_path: Path) -> None:
    """In a subprocess with a timeout: the old code blocks forever opening the FIFO."""
    hf = copy_of(hf_sharded, tmp_path)
    first = sorted(p.name for p in hf.glob("*.safetensors"))[0]
    (hf / first).unlink()
    os.mkfifo(hf / first)
    code = f"from kforge_cli import load_model\nload_model({str(hf)!r})\n"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "is not a regular file (a FIFO, device or directory)" in r.stderr, r.stderr[-2000:]


def _shrink(hf: Path, name: str) -> None:
    """Rewrite the safetensors file holding `name` with that tensor cut to shape [1] (broadcastable)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(hf.glob("*.safetensors")):
        tensors = load_file(str(path))
        if name in tensors:
            tensors[name] = tensors[name][:1].clone()
            save_file(tensors, str(path), metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} not found")


def test_weights_must_equal_the_config_shapes_exactly(hf_sharded: Path, tmp_path: Path) -> None:
    """A stored [1] norm weight would broadcast over the [dim] parameter (`copy_`): loaded silently, wrong."""
    hf = copy_of(hf_sharded, tmp_path)
    _shrink(hf, "model.norm.weight")
    with pytest.raises(CheckpointError, match=r"norm\.weight is stored as \(1,\), but the config describes \(32,\)"):
        load_model(hf)
    hf2 = copy_of(hf_sharded, tmp_path / "b")
    config = json.loads((hf2 / "config.json").read_text())
    config["intermediate_size"] = 1  # the config, not the weights, lies
    (hf2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"is stored as \(.*\), but the config describes"):
        load_model(hf2)


def test_hf_dir_without_tokenizer_json_is_an_error_in_generate(
    hf_sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import main

    hf = copy_of(hf_sharded, tmp_path)  # exported without a tokenizer
    assert not (hf / "tokenizer.json").exists()
    with pytest.raises(SystemExit) as done:
        main(["generate", str(hf), "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "has no tokenizer.json" in err and "--tokenizer" in err, err
    with pytest.raises(SystemExit) as done:  # naming one works
        main(["generate", str(hf), "--prompt", "hi", "--max-new-tokens", "2", "--tokenizer", "byte"])
    assert done.value.code == 2 and "tokenizer byte has 257 ids but the model's vocabulary is 64" in (
        capsys.readouterr().err
    )


def test_a_cached_max_id_is_verified_when_batches_are_read(tmp_path: Path) -> None:
    from kforge_cli.engine.data.prepare import prepare_data
    from kforge_cli.engine.data.shards import load_prepared
    from kforge_cli.engine.data.tokens import ShardedTokens, Windows

    src = tmp_path / "corpus.txt"
    src.write_text("hello world " * 400)
    prepare_data([src], tmp_path / "data", tokenizer="byte", val_fraction=0.1, workers=1)
    meta = json.loads((tmp_path / "data" / "metadata.json").read_text())
    shard = meta["splits"]["train"]["shards"][0]
    arr = np.load(tmp_path / "data" / shard["file"], mmap_mode="r+")
    arr[100] = 300  # beyond the vocabulary (257): the shard was changed after prepare-data cached its max_id
    arr.flush()
    del arr
    assert shard["max_id"] == 256  # the cache (EOS is the largest id) still passes the vocabulary check
    info = load_prepared(tmp_path / "data").splits["train"]
    windows = Windows(ShardedTokens(info), 16)
    windows.rows(np.array([0]))  # tokens 0..16 are honest
    with pytest.raises(InvalidInputError, match=r"holds token id 300, above the max_id 256 its metadata\.json"):
        windows.rows(np.array([6]))  # tokens 96..113 hold the planted id


def test_kforge_runs_does_not_hang_on_fifos(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = runs / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    os.mkfifo(run / "config.toml")  # the old code blocked forever reading it
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run(
        [sys.executable, "-m", "kforge_cli", "runs", str(runs)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "r1" in r.stdout and "2.5" in r.stdout, r.stderr[-2000:]
