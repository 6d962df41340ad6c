"""One error path (issue 29, class 9): what the user caused exits 2 naming the file and field; a kforge
bug keeps its traceback and says so.

Everything goes through `main()`, as the console script runs it: a `--device cuda` on a host
without CUDA, a tokenizer that panics (a Rust panic is a BaseException), deep nesting, a
``\\xff`` byte or a 5000-digit number in a config.toml or a multiple-choice JSONL, a choice
longer than max_seq_len, a Hugging Face config.json missing or mangling a key, an OSError on
a named file, and a dangling step_N link where a checkpoint is saved.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.cli.app import main
from kforge_cli.engine.interop.hf_export import export_hf
from tests.unit.test_checkpoint_hostile import saved

BAD_TEXT = {
    "nested": "[" * 50_000,
    "byte_ff": b"\xff\xfe".decode("latin-1"),
    "digits_5000": "9" * 5000,
}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kforge ARGS` in this process: (exit code, stderr); any other exception propagates (a traceback)."""
    with pytest.raises(SystemExit) as done:
        main(list(args))
    return int(done.value.code or 0), capsys.readouterr().err


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved(tmp_path_factory.mktemp("errors") / "run")[0]


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-id word-level tokenizer (fits the 64-id test model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "word": 1, "a": 2, "b": 3, "the": 4, "<|endoftext|>": 5}
    tok = Tokenizer(models.WordLevel(vocab, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "words.json"
    tok.save(str(path))
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_device_cuda_on_a_cpu_host(step: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["generate", str(step), "--prompt", "a"], ["eval", str(step), "--task", "heldout"]):
        code, err = cli(capsys, *command, "--device", "cuda")
        assert code == 2 and "--device cuda: this machine has no usable CUDA GPU" in err and "Traceback" not in err
    code, err = cli(capsys, "generate", str(step), "--prompt", "a", "--device", "tpu")
    assert code == 2 and "--device 'tpu'" in err


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic (tokenizers' regexes): not an Exception."""


def test_a_tokenizer_that_panics(
    step: Path, words: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.engine.data import tokenizer as tokenizer_module

    real = tokenizer_module.HFTokenizer.__init__

    def panicking(self: Any, path: Any) -> None:
        real(self, path)

        class Panics:
            def __getattr__(self, name: str) -> Any:
                def boom(*args: Any, **kwargs: Any) -> Any:
                    raise PanicException("called `Result::unwrap()` on an `Err` value")

                return boom

        self._tok = Panics()

    monkeypatch.setattr(tokenizer_module.HFTokenizer, "__init__", panicking)
    code, err = cli(capsys, "generate", str(step), "--prompt", "the word", "--tokenizer", str(words))
    assert code == 2 and f"tokenizer file {words} failed on the text (PanicException" in err, err


@pytest.mark.parametrize("bad", list(BAD_TEXT), ids=list(BAD_TEXT))
def test_a_damaged_config_toml_names_the_file(tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.toml"
    config.write_bytes(f"[train]\nmax_steps = {BAD_TEXT[bad]}\n".encode("latin-1"))
    code, err = cli(capsys, "validate-config", "--config", str(config))
    assert code == 2 and "Traceback" not in err, err
    assert f"config file {config} is not valid TOML" in err or f"config file {config} is not UTF-8 text" in err, err
    run = tmp_path / "run"  # a run whose saved config.toml is damaged the same way
    run.mkdir()
    shutil.copy(config, run / "config.toml")
    code, err = cli(capsys, "resume", str(run))
    assert code == 2 and f"{run / 'config.toml'} is not" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[" * 50_000, "is nested too deeply"),
        ('{"context": "a", "choices": ["a", "b"], "answer": ' + "9" * 5000 + "}", "is not JSON"),
        (b'{"context": "\xff"}'.decode("latin-1"), "is not UTF-8 text"),
    ],
    ids=["nested", "digits_5000", "byte_ff"],
)
def test_a_damaged_multiple_choice_file_names_the_line(
    step: Path, words: Path, tmp_path: Path, line: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    task = tmp_path / "mc.jsonl"
    good = json.dumps({"context": "the", "choices": [" a", " b"], "answer": 0})
    task.write_bytes(f"{good}\n{line}\n".encode("latin-1"))
    code, err = cli(capsys, "eval", str(step), "--task", str(task), "--tokenizer", str(words))
    assert code == 2 and f"{task}:2 {why}" in err and "Traceback" not in err, err


def test_a_choice_longer_than_max_seq_len(
    step: Path, words: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({"context": "the", "choices": [" a", " word" * 40], "answer": 0}) + "\n")
    code, err = cli(capsys, "eval", str(step), "--task", str(task), "--tokenizer", str(words))
    assert code == 2 and f"{task}:1: choices[1] has at least 40 tokens" in err and "max_seq_len=32" in err, err


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c.pop("hidden_size"), ": Hugging Face config lacks or mangles 'hidden_size'"),
        (lambda c: c.update(rope_parameters="yes"), " has a field kforge cannot use"),
        (lambda c: c.update(vocab_size=-5), ": vocab_size = -5 is not an integer from 1"),
    ],
    ids=["missing_key", "mangled_rope", "negative_vocab"],
)
def test_a_hf_config_missing_or_mangling_a_key(
    step: Path, tmp_path: Path, edit: Any, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "hf"
    export_hf(step, hf, tokenizer="none")
    config = json.loads((hf / "config.json").read_text())
    edit(config)
    (hf / "config.json").write_text(json.dumps(config))
    code, err = cli(capsys, "generate", str(hf), "--prompt", "a", "--tokenizer", "byte")
    assert code == 2 and f"{hf / 'config.json'}{named}" in err and "Traceback" not in err, err


def test_an_os_error_on_a_named_file_is_the_users_and_anything_else_a_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli import runs_table

    (tmp_path / "runs").mkdir()

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(tmp_path / "runs" / "r1"))

    monkeypatch.setattr(runs_table, "list_runs", denied)
    code, err = cli(capsys, "runs", str(tmp_path / "runs"))
    assert code == 2 and err.strip() == f"error: {tmp_path / 'runs' / 'r1'}: Permission denied"

    def bug(*args: Any, **kwargs: Any) -> Any:
        return {}["no such key"]

    monkeypatch.setattr(runs_table, "list_runs", bug)
    code, err = cli(capsys, "runs", str(tmp_path / "runs"))
    assert code == 1 and "Traceback (most recent call last)" in err and "KeyError: 'no such key'" in err
    assert "this is a kforge bug (KeyError), not a mistake of yours" in err and "report it" in err


def test_a_dangling_step_link_where_a_checkpoint_is_saved(tmp_path: Path) -> None:
    from kforge_cli.rundir.checkpoints import is_complete
    from tests.unit.test_checkpoint_manager import make_run, train

    run = make_run(tmp_path)
    run.manager.restore()
    train(run, 1)
    root = tmp_path / "checkpoints"
    root.mkdir(exist_ok=True)
    os.symlink(tmp_path / "gone" / "step_1", root / "step_1")  # points nowhere
    path = run.manager.save(1)
    assert path == root / "step_1" and not path.is_symlink() and is_complete(path)
    assert not (tmp_path / "gone").exists()


def test_device_memory_and_a_failed_collective_are_not_called_kforge_bugs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from kforge_cli.cli import runs_table

    (tmp_path / "runs").mkdir()

    def oom(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runs_table, "list_runs", oom)
    code, err = cli(capsys, "runs", str(tmp_path / "runs"))
    assert code == 1 and "out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in err, err
    assert "`kforge plan`" in err and "Traceback" not in err and "kforge bug" not in err

    def collective(*args: Any, **kwargs: Any) -> Any:
        raise torch.distributed.DistBackendError("Connection closed by peer")

    monkeypatch.setattr(runs_table, "list_runs", collective)
    code, err = cli(capsys, "runs", str(tmp_path / "runs"))
    assert code == 1 and "a collective failed (DistBackendError)" in err and "kforge bug" not in err, err
