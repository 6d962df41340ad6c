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
