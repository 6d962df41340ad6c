"""Every command's --help reads as written: no word lost to markup, no mid-sentence breaks, no backticks."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kforge_cli.cli.app import app
from kforge_cli.cli.help_text import readable_help

BOX = re.compile(r"[│╭╮╰╯─]")


def commands(group: typer.Typer, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """(argv prefix, callback) of every command, sub-apps included."""
    found = [((*prefix, info.name or ""), info.callback) for info in group.registered_commands]
    for sub in group.registered_groups:
        assert sub.typer_instance is not None and sub.name
        found += commands(sub.typer_instance, (*prefix, sub.name))
        callback = sub.typer_instance.registered_callback
        if callback is not None:
            found.append(((*prefix, sub.name), callback.callback))
    return found


ALL = commands(app)


def render(*argv: str) -> list[str]:
    """`kforge ARGV --help` as a terminal 500 columns wide shows it: lines without box drawing."""
    result = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "500", "TERMINAL_WIDTH": "500"})
    assert result.exit_code == 0, result.output
    return [" ".join(BOX.sub(" ", line).split()) for line in result.output.splitlines()]


def paragraphs(doc: str) -> list[str]:
    """The docstring's paragraphs as a reader should see them: one line each, code spans without backticks."""
    return [" ".join(p.replace("`", "").split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]


def test_every_command_is_covered() -> None:
    names = {" ".join(argv) for argv, _ in ALL}
    assert {"train", "convert-mot", "prepare-data", "profiles", "profiles show"} <= names


@pytest.mark.parametrize(("argv", "callback"), ALL, ids=[" ".join(a) for a, _ in ALL])
def test_help_shows_every_paragraph_whole_with_its_brackets(argv: tuple[str, ...], callback: object) -> None:
    lines = render(*argv)
    doc = inspect.getdoc(callback)
    assert doc, f"kforge {' '.join(argv)} has no help"
    for paragraph in paragraphs(doc):
        assert any(paragraph in line for line in lines), f"{paragraph!r} is not one whole line of:\n" + "\n".join(lines)
    command: Any = typer.main.get_command(app)
    for name in argv:
        command = command.commands[name]  # a group's subcommands (typer's own click)
    for param in command.params:
        text = " ".join((getattr(param, "help", None) or "").split())
        assert not text or any(text in line for line in lines), f"option help {text!r} lost or broken"
    assert not any("`" in line for line in lines)


def test_the_words_markup_used_to_eat_are_shown() -> None:
    assert any("pip install 'kforge[hf]'" in line for line in render("prepare-data"))
    convert = " ".join(render("convert-mot"))
    assert "its [model] table must describe the dense model" in convert
    assert "Default: cpu-debug" not in convert and "Default: vlm-mot-debug" in convert
    assert any("Exit codes: 0 done, 1 failure, 2 invalid input" in line for line in render("train"))


def test_readable_help_escapes_only_what_rich_would_eat() -> None:
    assert readable_help("Needs `pip install 'kforge[hf]'`.\nSecond line [0, 1) and [HF].") == (
        "Needs [bold]pip install 'kforge\\[hf]'[/bold]. Second line [0, 1) and [HF]."
    )
    assert readable_help("Items:\n- one\n- two") == "Items:\n- one\n- two"


def test_the_command_list_shows_each_commands_first_paragraph_whole() -> None:
    lines = render()
    for argv, callback in ALL:
        if len(argv) == 1:
            first = paragraphs(inspect.getdoc(callback) or "")[0]
            assert any(first in line for line in lines), f"{argv[0]}: {first!r}"
