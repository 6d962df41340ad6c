"""Hostile and damaged inputs, fourth pass (issue 40, classes 2 to 9).

Each test names its class. None of these inputs may reach main()'s bug path: each is exit 2
naming the file or key and what to do, with nothing written outside the run directory.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from kforge_cli.cli.app import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


# Class 4: the prompt of `generate` is read capped, from a file and from standard input.


def test_class4_a_prompt_file_or_stdin_is_read_capped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kforge_cli.cli.generate import MAX_PROMPT_BYTES

    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:  # sparse: 1 GiB of NULs costs no disk
        f.truncate(1 << 30)
    missing = str(tmp_path / "no_such_run")  # the prompt is refused before any checkpoint is opened
    code, _, err = run_cli(["generate", missing, "--prompt-file", str(huge)], capsys)
    assert code == 2 and "Traceback" not in err and f"--prompt-file {huge}" in err, err
    assert f"longer than {MAX_PROMPT_BYTES} bytes" in err
    if os.path.exists("/dev/zero"):
        code, _, err = run_cli(["generate", missing, "--prompt-file", "/dev/zero"], capsys)
        assert code == 2 and "not a regular file" in err and "standard input" in err, err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a" * (MAX_PROMPT_BYTES + 10))))
    code, _, err = run_cli(["generate", missing], capsys)
    assert code == 2 and "standard input is longer than" in err, err


# Class 2: an lm-eval task YAML runs Python only with --allow-hooks, and is bounded before it is parsed.


def _task_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A task YAML whose included base names `!function utils.process_docs`: (the YAML, the marker)."""
    folder = tmp_path / "task"
    folder.mkdir()
    marker = tmp_path / "IMPORTED"
    (folder / "utils.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef process_docs(ds):\n    return ds\n")
    (folder / "base.yaml").write_text("output_type: multiple_choice\nprocess_docs: !function utils.process_docs\n")
    (folder / "mine.yaml").write_text("include: base.yaml\ntask: mine\ndataset_path: json\n")
    return folder / "mine.yaml", marker


def test_class2_a_task_file_runs_python_only_when_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lm_eval")
    task, marker = _task_folder(tmp_path)
    missing = str(tmp_path / "no_such_run")  # refused before any checkpoint is opened
    code, _, err = run_cli(["eval", missing, "--task", f"lm-eval:{task}"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert "utils.process_docs" in err and str(task.parent / "utils.py") in err and "--allow-hooks=utils" in err
    assert not marker.exists()  # nothing imported
    code, _, err = run_cli(["eval", missing, "--task", f"lm-eval:{task}", "--allow-hooks=other"], capsys)
    assert code == 2 and not marker.exists(), err
    from kforge_cli.engine.evaluation.lm_eval_adapter import task_config
    from kforge_cli.settings.task_code import task_code

    assert task_config(task, ["utils"])["task"] == "mine" and marker.read_text() == "ran"  # the explicit yes
    import lm_eval.tasks

    builtin = Path(lm_eval.tasks.__file__).parent / "hellaswag" / "hellaswag.yaml"
    assert "!function" in builtin.read_text() and task_code(builtin) == []  # the harness's own need no consent


def test_class2_a_task_file_is_bounded_before_it_is_parsed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    pytest.importorskip("lm_eval")
    import kforge_cli.settings.task_code as adapter

    nodes, size = getattr(adapter, "MAX_TASK_YAML_NODES", 100_000), getattr(adapter, "MAX_TASK_YAML_BYTES", 1 << 20)
    bomb = ["task: bomb", 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    bomb += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    assert (tmp_path / "bomb.yaml").stat().st_size < 1600
    (tmp_path / "big.yaml").write_text("task: big\n" + "#" * size + "\n")
    (tmp_path / "loop.yaml").write_text("include: loop2.yaml\ntask: loop\n")
    (tmp_path / "loop2.yaml").write_text("include: loop.yaml\n")
    missing = str(tmp_path / "no_such_run")
    start = time.monotonic()
    code, _, err = run_cli(["eval", missing, "--task", f"lm-eval:{tmp_path / 'bomb.yaml'}"], capsys)
    assert code == 2 and f"more than {nodes} YAML nodes" in err, err
    assert time.monotonic() - start < 5
    code, _, err = run_cli(["eval", missing, "--task", f"lm-eval:{tmp_path / 'big.yaml'}"], capsys)
    assert code == 2 and f"larger than {size} bytes" in err, err
    code, _, err = run_cli(["eval", missing, "--task", f"lm-eval:{tmp_path / 'loop.yaml'}"], capsys)
    assert code == 2 and "Traceback" not in err, err  # the include cycle ends; the checkpoint is what is missing


# Class 3: a layout trial runs only inside its own directory, and a failed trial fails the command.

TRIAL_MODEL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1"]
TRIAL_MODEL += ["--train.seq_len=32", "--model.max_seq_len=32", "--train.batch_size=2", "--train.num_threads=1"]


def _real_run(tmp_path: Path) -> Path:
    """A run with a saved checkpoint (someone's real work)."""
    run = tmp_path / "real_run"
    code = main_code(
        ["train", "--run-dir", str(run), *TRIAL_MODEL, "--train.max_steps=2", "--metrics.progress_bar=off"]
    )
    assert code == 0 and (run / "checkpoints" / "step_2").is_dir()
    return run


def main_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def test_class3_a_trial_never_touches_another_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _real_run(tmp_path)
    before = _snapshot(real)
    config = tmp_path / "aimed.toml"
    config.write_text(
        f'[checkpoint]\ndir = "{real / "checkpoints"}"\ninit_from = "{real / "checkpoints" / "step_2"}"\n'
        'keep_last_n = 1\n[metrics]\nbackends = ["jsonl", "tensorboard"]\n'
    )
    monkeypatch.setenv("KFORGE_CHECKPOINT__LOAD_PATH", str(real / "checkpoints" / "step_2"))
    out = tmp_path / "trials"
    argv = ["plan", "trial", "--world-size", "1", "--config", str(config), *TRIAL_MODEL]
    capsys.readouterr()
    code, _, err = run_cli([*argv, "--best", "1", "--steps", "3", "--trial-dir", str(out)], capsys)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "not using checkpoint.dir=" in err and "checkpoint.init_from=" in err and "checkpoint.load_path=" in err
    assert _snapshot(real) == before  # nothing resumed, retained, written or deleted there
    profile = (out / "trial-1" / "profile.toml").read_text()
    assert str(real) not in profile and "tensorboard" not in profile
    import json

    trial = json.loads((out / "trials.json").read_text())["trials"][0]
    assert trial["exit_code"] == 0 and trial["timed_steps"] == 2  # it trained, from step 0
    assert (out / "trial-1" / "run" / "metrics.jsonl").is_file()

    import subprocess

    import kforge_cli.engine.trials.runner as trials

    def ran_nothing(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        return subprocess.CompletedProcess(cmd, 0)  # exit 0, no step measured

    monkeypatch.setattr(trials.subprocess, "run", ran_nothing)
    code, out_text, err = run_cli([*argv, "--best", "1", "--steps", "3", "--trial-dir", str(tmp_path / "t2")], capsys)
    assert code == 1 and "exit 0 but no timed step measured" in out_text and "1 of 1 trials failed" in err, err


# Class 5: a crafted Hugging Face config is refused by one bounded reader, for every class kforge imports.

ERNIE = {
    "model_type": "ernie4_5_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 256,
    "moe_intermediate_size": 32,
    "moe_num_experts": 4,
    "moe_k": 2,
    "moe_layer_interval": 1,
}


@pytest.mark.parametrize(
    ("kind", "edit", "key"),
    [
        ("ernie4_5_moe", {"moe_layer_interval": 0}, "moe_layer_interval"),
        ("ernie4_5_moe", {"num_hidden_layers": 10**12}, "num_hidden_layers"),
        ("ernie4_5_moe", {"num_hidden_layers": 1e12}, "num_hidden_layers"),
        (
            "glm4_moe",
            {"n_group": 0, "n_routed_experts": 4, "num_experts_per_tok": 2, "partial_rotary_factor": 1.0},
            "n_group",
        ),
        ("qwen3_moe", {"decoder_sparse_step": 0, "num_experts": 4, "num_experts_per_tok": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": list(range(10**5))}, "mlp_only_layers"),
        ("llama", {"num_attention_heads": 0}, "num_attention_heads"),
        ("qwen3", {"vocab_size": True}, "vocab_size"),
        ("llama", {"rope_theta": "inf"}, "rope_theta"),
        ("llama", {"text_config": {"num_hidden_layers": -1}}, "text_config.num_hidden_layers"),
    ],
)
def test_class5_a_crafted_hf_config_is_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, edit: dict[str, object], key: str
) -> None:
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**ERNIE, "model_type": kind, **edit}))
    (hf / "model.safetensors").write_bytes(b"")
    code, _, err = run_cli(["generate", str(hf), "--prompt", "x", "--tokenizer", "byte"], capsys)
    assert code == 2 and "Traceback" not in err and "kforge bug" not in err, err
    assert str(hf / "config.json") in err and key in err, err


# Class 6: numbers at the edges are refused by their documented range, never a traceback.


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--train.max_steps=" + "9" * 5000], "override --train.max_steps: its value is not usable"),
        (["--train.hooks=" + "[" * 30000 + "]" * 30000], "nested too deeply"),
        (["--train.max_steps=" + "9" * 400], "train.max_steps: Value error, must be an integer from"),
        (
            ["--resilience.hang_timeout_s=1e30"],
            "resilience.hang_timeout_s: Input should be less than or equal to 604800",
        ),
        (["--distributed.timeout_s=" + "9" * 15], "distributed.timeout_s: Input should be less than or equal to"),
        (["plan", "search", "--mfu", "nan"], "--mfu must be a number in (0, 1]"),
        (["plan", "search", "--mfu", "-1"], "--mfu must be a number in (0, 1]"),
        (["plan", "search", "--world-size", "1000000007"], "--world-size must be from 1 to 1,048,576"),
        (["plan", "trial", "--best", "1", "--steps", "1" + "0" * 23], "--steps must be from 2 to 100,000"),
        (["--slurm.nodes=1048576", "--slurm.gpus_per_node=8"], "above kforge's maximum world size 1,048,576"),
    ],
    ids=[
        "5000_digits",
        "30000_deep",
        "400_digits",
        "hang_1e30",
        "pg_timeout",
        "mfu_nan",
        "mfu_neg",
        "world_1e9",
        "steps_24_digits",
        "slurm_world",
    ],
)
def test_class6_numbers_at_the_edges_are_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    start = time.monotonic()
    command = argv if argv[0] == "plan" else ["validate-config", *argv]
    code, _, err = run_cli(command, capsys)
    assert code == 2 and "Traceback" not in err and said in err, err[-2000:]
    assert len(err) < 2000 and time.monotonic() - start < 10  # the value is not echoed whole; no search ran


def test_class6_the_layout_search_is_bounded_in_time() -> None:
    from kforge_cli.engine.plan.search import search_layouts
    from kforge_cli.errors import InvalidInputError
    from kforge_cli.settings import load_settings

    settings = load_settings(use_env=False).settings
    with pytest.raises(InvalidInputError, match="did not finish within 0 s"):
        search_layouts(settings, 8, time_limit_s=0.0)
    with pytest.raises(InvalidInputError, match="kforge's maximum"):
        search_layouts(settings, 1_000_000_007)


def test_class6_a_huge_integer_loss_in_metrics_does_not_crash_runs_or_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    rows = [json.dumps({"step": s, "loss": 2.0 / s, "tokens_seen": 64 * s}) for s in range(1, 5)]
    rows.insert(2, '{"step": 3, "loss": ' + "9" * 400 + ', "tokens_seen": 192}')
    rows.append('{"step": ' + "9" * 400 + ', "loss": 0.1}')
    rows.append(json.dumps({"step": 5, "loss": 0.25, "tokens_seen": 320}))
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    code, out, err = run_cli(["runs", str(tmp_path / "runs"), "--json"], capsys)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    row = json.loads(out.strip().splitlines()[0])
    assert row["last_loss"] == 0.25
    for x in ("step", "tokens"):
        code, _, err = run_cli(["plot", str(run), "-o", str(tmp_path / f"{x}.png"), "--x", x], capsys)
        assert code == 0 and (tmp_path / f"{x}.png").stat().st_size > 0, err[-2000:]


# Class 7: "printable" includes Unicode format and separator characters, for every name.


@pytest.mark.parametrize(
    ("key", "char"),
    [
        ("slurm.job_name", "\u202e"),  # right-to-left override
        ("metrics.run_name", "\u200b"),  # zero-width space
        ("train.run_dir", "\u2028"),  # line separator
        ("metrics.tags", "\u2029"),  # paragraph separator
        ("slurm.partition", "\u00a0"),  # a no-break space looks like " "
        ("metrics.wandb_group", "\ufeff"),  # zero-width no-break space (BOM)
        ("data.tokenizer", "\u2066"),  # left-to-right isolate
    ],
)
def test_class7_unicode_format_and_separator_characters_are_refused(
    key: str, char: str, capsys: pytest.CaptureFixture[str]
) -> None:
    value = f'["a{char}b"]' if key == "metrics.tags" else f"a{char}b"
    code, _, err = run_cli(["validate-config", f"--{key}={value}"], capsys)
    assert code == 2 and key in err and f"U+{ord(char):04X}" in err, err


def test_class7_a_task_name_and_a_profile_name_must_be_printable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = tmp_path / "mc\u202etxt.jsonl"
    task.write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n')
    code, _, err = run_cli(["eval", str(tmp_path / "no_such_run"), "--task", str(task)], capsys)
    assert code == 2 and "U+202E" in err and "rename the file" in err, err
    profile = tmp_path / "p\u200b.toml"
    profile.write_text('description = "x"\n')
    code, _, err = run_cli(["validate-config", "--profile", str(profile)], capsys)
    assert code == 2 and "U+200B" in err, err
    assert run_cli(["validate-config", "--metrics.run_name=plain name é ü 日本"], capsys)[0] == 0  # letters and " "


# Class 9: prepared data is checked, not trusted: a damaged metadata.json exits 2 naming file and key.


def _prepared(tmp_path: Path) -> Path:
    from kforge_cli.engine.data.prepare import prepare_data

    src = tmp_path / "corpus.txt"
    src.write_text("hello world " * 400)
    prepare_data([src], tmp_path / "data", tokenizer="byte", val_fraction=0.1, workers=1)
    return tmp_path / "data"


@pytest.mark.parametrize("bad", ["512", 512.5, [512], None, True, "9" * 30])
def test_class9_a_non_integer_vocab_size_names_the_file_and_key(
    tmp_path: Path, bad: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    data = _prepared(tmp_path)
    meta = json.loads((data / "metadata.json").read_text())
    meta["vocab_size"] = bad
    (data / "metadata.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["validate-config", f"--data.path={data}"], capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"{data / 'metadata.json'}: vocab_size is" in err and "prepare it again" in err, err


def test_class9_an_uncached_max_id_cannot_switch_off_the_read_check(tmp_path: Path) -> None:
    import json

    import numpy as np

    from kforge_cli.engine.data.shards import load_prepared
    from kforge_cli.errors import InvalidInputError

    data = _prepared(tmp_path)
    meta = json.loads((data / "metadata.json").read_text())
    shard = meta["splits"]["train"]["shards"][0]
    arr = np.load(data / shard["file"], mmap_mode="r+")
    arr[100] = 300  # beyond the vocabulary (257)
    arr.flush()
    del arr
    shard["max_id"] = -1  # "empty": would skip the check on every read
    (data / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidInputError, match=rf"shard {shard['file']}: max_id -1 does not fit its \d+ tokens"):
        load_prepared(data)


# Class 8: a full disk during a save prints the one clear message, no torch traceback before it.


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a writer thread's traceback
def test_class8_a_full_disk_prints_no_traceback_before_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from kforge_cli.rundir.checkpoints import read_latest

    write_item = dcp_fs._write_item

    def full_at_step_2(*args: object, **kwargs: object) -> object:  # an ENOSPC in DCP's writer threads
        if any("step_2" in str(getattr(a, "name", "")) for a in args):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_item(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", full_at_step_2)
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), *TRIAL_MODEL, "--train.max_steps=2", "--checkpoint.interval=1"]
    code = main_code([*argv, "--metrics.progress_bar=off", "--checkpoint.write_threads=2"])
    out, err = capfd.readouterr()
    assert code == 1 and "Traceback" not in out + err and "Exception in thread" not in err, err[-3000:]
    assert "disk full (ENOSPC) while saving checkpoint" in err and "step_1 is intact and stays latest" in err
    assert read_latest(run / "checkpoints") == run / "checkpoints" / "step_1"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> object:
    """A 1.5 MiB tmpfs (room for one tiny checkpoint, not two); skipped where mounting is not allowed."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a size-limited tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_class8_a_real_full_filesystem(tmp_path: Path, small_tmpfs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from kforge_cli.rundir.checkpoints import read_latest

    run, ckpts = tmp_path / "run", small_tmpfs / "ckpt"
    argv = ["train", "--run-dir", str(run), *TRIAL_MODEL, "--train.max_steps=3", "--checkpoint.interval=1"]
    code = main_code([*argv, f"--checkpoint.dir={ckpts}", "--metrics.progress_bar=off", "--checkpoint.write_threads=2"])
    out, err = capfd.readouterr()
    assert code == 1 and "Traceback" not in out + err and "Exception in thread" not in err, err[-3000:]
    assert "disk full (ENOSPC) while saving checkpoint" in err and "is intact and stays latest" in err, err[-2000:]
    latest = read_latest(ckpts)
    assert latest is not None and (latest / "kforge_commit.json").is_file()
