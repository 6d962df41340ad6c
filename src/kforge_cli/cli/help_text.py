"""Command help as a person would write it: whole paragraphs, every word kept, no markup showing.

Typer renders help with rich markup, which eats anything that looks like a tag
(``pip install 'kforge[hf]'`` became ``pip install 'kforge'``, "its [model] must" became
"its  must"), keeps the line breaks of a hard-wrapped docstring ("0 done,\\n1 failure")
and shows Markdown-style backticks literally. Docstrings stay plain, readable source;
:func:`readable_help` turns one into what rich should render, and :func:`apply_readable_help`
does it for every command of the app. Pure string work: no rich import, so startup stays fast.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import typer

# What rich would parse as a markup tag: "[" then a lowercase letter, "#", "/" or "@", up to "]".
_RICH_TAG = re.compile(r"\[(?=[a-z#/@][^\[\]]*\])")
_CODE_SPAN = re.compile(r"``?([^`]+?)``?")
_LIST_ITEM = re.compile(r"\s*([-*]|\d+[.)])\s")


def escape_markup(text: str) -> str:
    """``text`` with every would-be rich tag escaped, so it prints literally."""
    return _RICH_TAG.sub(r"\\[", text)


def _join_lines(paragraph: str) -> str:
    """One line per sentence run: a hard-wrapped paragraph joined; list items keep their own lines."""
    lines = paragraph.splitlines()
    if any(_LIST_ITEM.match(line) for line in lines):
        return "\n".join(line.rstrip() for line in lines)
    return " ".join(line.strip() for line in lines)


def readable_help(doc: str) -> str:
    """Rich-markup help from a plain docstring: paragraphs joined, markup escaped, code spans in bold."""
    paragraphs = [p for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]
    out = []
    for paragraph in paragraphs:
        text = escape_markup(_join_lines(paragraph))
        out.append(_CODE_SPAN.sub(lambda m: f"[bold]{m.group(1)}[/bold]", text))
    return "\n\n".join(out)


def plain_help(doc: str) -> str:
    """The text a reader should see for ``doc`` (what tests compare the rendered help against)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]
    return "\n\n".join(_CODE_SPAN.sub(r"\1", _join_lines(p)) for p in paragraphs)


def apply_readable_help(app: typer.Typer) -> None:
    """Give every registered command (and sub-app) the readable form of its docstring or help."""
    for info in app.registered_commands:
        source = info.help if info.help is not None else inspect.getdoc(info.callback) or ""
        info.help = readable_help(source)
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub is None:
            continue
        callback = sub.registered_callback
        if callback is not None and callback.callback is not None:  # a group's help is its callback's docstring
            group.help = readable_help(inspect.getdoc(callback.callback) or "")
        apply_readable_help(sub)


def plain_metavars(command: object) -> None:
    """Help that names things as the text does: ``RUN_DIR`` rather than ``run_dir``, and no ``<bool>``
    after a flag (a flag takes no value). Applied to the click command typer built, every subcommand."""
    for param in getattr(command, "params", []):
        if getattr(param, "param_type_name", "") == "argument" and getattr(param, "required", False):
            param._usage_display_name = _bare_usage(param)  # `RUN_DIR`, not typer's `{RUN_DIR}`
        if getattr(param, "metavar", "") is not None:
            continue
        if getattr(param, "param_type_name", "") == "argument" and param.name:
            param.metavar = param.name.upper()
        elif getattr(param, "is_flag", False):
            param.metavar = ""
    help_option = getattr(command, "get_help_option", None)
    if help_option is not None and not getattr(command, "_kforge_plain_help", False):
        setattr(command, "get_help_option", _flag_help(help_option))  # noqa: B010 (`--help`, not `--help <bool>`)
        setattr(command, "_kforge_plain_help", True)  # noqa: B010
    for sub in (getattr(command, "commands", None) or {}).values():
        plain_metavars(sub)


def _bare_usage(param: Any) -> Callable[[], str]:
    def usage() -> str:
        return str(param.display_name_raw) + ("..." if param.nargs != 1 else "")

    return usage


def _flag_help(get_help_option: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def plain(ctx: Any) -> Any:
        option = get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    return plain
