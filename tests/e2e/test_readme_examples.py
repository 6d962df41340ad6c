"""Every command in the README's code blocks runs as written (those that need no GPU or network).

The README's commands are read from its fenced and indented code blocks (a line, or each
``&&``-joined part of one, that starts with ``kforge``), and each must be listed here either
in RUN (executed in README order, in one scratch directory, exit code 0) or in NOT_RUN with the
reason. The data the examples name (``my_corpus/``) is prepared first. Training commands run
with ``KFORGE_TRAIN__MAX_STEPS`` set low (an environment setting; a command-line
``--train.max_steps`` still wins), so the suite stays short.
"""

from __future__ import annotations

import random
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import run_kforge

pytestmark = pytest.mark.e2e

README = Path(__file__).parents[2] / "README.md"

# The README's commands that this test runs, in README order.
RUN = [
    "kforge prepare-data my_corpus/ --tokenizer byte --out data/mine",
    "kforge train --data.path=data/mine --run-dir runs/mine",
    "kforge plan --profile h100x64",
    "kforge plan search --profile h100x64 --write-profile best.toml",
    'kforge generate runs/mine -p "Once upon a time" --max-new-tokens 40',
    "kforge train",
    "kforge train --optimizer.lr=1e-3 --train.max_steps=30 --run-dir runs/quick",
    "kforge validate-config --explain scheduler.warmup_steps",
    "kforge profiles",
]
# Commands (or parts of a command line) in the README that are not run, and why.
NOT_RUN = {
    "python3 -m venv .venv": "creates a virtual environment (the tests already run in one)",
    ". .venv/bin/activate": "activates that environment",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "installs from the network",
    "pip install -e .": "installs from the network",
    "bash .ci/run": "runs the whole suite, this test included",
    "python -m pytest -q tests/unit -x": "runs the unit tests (a suite of its own)",
}
ENV = {"KFORGE_TRAIN__MAX_STEPS": "20", "KFORGE_METRICS__PROGRESS_BAR": "off", "KFORGE_METRICS__LOG_INTERVAL": "5"}


def code_block_lines(markdown: str) -> list[tuple[str, bool]]:
    """(line, is_shell) of fenced (```) and indented (4 spaces, after a blank line) code blocks, in order.

    ``is_shell``: from a ```bash block, where every line is a command; indented blocks also hold
    listings (the run directory), so only their ``kforge`` lines count.
    """
    lines, out, fence, indented = markdown.splitlines(), [], None, False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        if fence is not None:
            out.append((line, fence in ("bash", "sh", "shell")))
            continue
        starts_block = line.startswith("    ") and (i == 0 or not lines[i - 1].strip() or indented)
        indented = bool(starts_block and line.strip())
        if indented:
            out.append((line.strip(), False))
    return out


def readme_commands(markdown: str) -> list[str]:
    """Each command of the README's code blocks, ``&&`` parts split, comments and spacing normalised."""
    commands = []
    for line, is_shell in code_block_lines(markdown):
        for part in re.split(r"\s&&\s", line):
            words = shlex.split(part, comments=True)
            if words and (is_shell or words[0] == "kforge"):
                commands.append(shlex.join(words))
    return commands


def _normalise(command: str) -> str:
    return shlex.join(shlex.split(command))


def write_corpus(root: Path) -> None:
    """``my_corpus/``: three text files of simple sentences (~150 KB), enough for a train and a val split."""
    rng = random.Random(0)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
    verbs = ["sees", "likes", "finds", "follows", "helps", "remembers"]
    objects = ["the river", "a red ball", "the garden", "an open door", "the morning light", "a quiet song"]
    corpus = root / "my_corpus"
    corpus.mkdir()
    for n in range(3):
        sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(1500)]
        (corpus / f"part{n}.txt").write_text("\n".join(sentences) + "\n")


def test_the_readme_lists_exactly_the_commands_this_test_knows() -> None:
    found = readme_commands(README.read_text())
    kforge = [c for c in found if c.startswith("kforge ") or c == "kforge"]
    assert kforge == [_normalise(c) for c in RUN], "a README command changed: update RUN (or NOT_RUN, with why)"
    others = [c for c in found if c not in kforge]
    assert sorted(others) == sorted(_normalise(c) for c in NOT_RUN)


def test_every_readme_command_that_needs_no_gpu_runs_as_written(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    ran = []
    for command in RUN:
        r = run_kforge(*shlex.split(command)[1:], cwd=tmp_path, env=ENV, timeout=900)
        assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stderr[-3000:]}"
        ran.append(command)
    print("README commands run:\n  " + "\n  ".join(ran))
    print("not run:\n  " + "\n  ".join(f"{c}  ({why})" for c, why in NOT_RUN.items()))
    assert (tmp_path / "data" / "mine" / "metadata.json").is_file()
    assert (tmp_path / "runs" / "mine" / "checkpoints" / "latest").is_file()
    assert (tmp_path / "runs" / "quick" / "checkpoints" / "step_30").is_dir()  # the command line beats the env
    assert len(list((tmp_path / "runs").glob("cpu-debug-*"))) == 1  # the default job's run directory
