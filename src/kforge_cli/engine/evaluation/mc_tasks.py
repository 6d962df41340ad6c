"""Multiple-choice tasks from local JSONL: one ``{"context", "choices", "answer"}`` object per line.

``answer`` is the index of the right choice. Each choice is scored as the
log-likelihood of its tokens after the context's (the continuation is appended as
written, so put the separating space at the start of each choice, as lm-evaluation-harness does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.common.files import open_regular
from kforge_cli.errors import InvalidInputError


@dataclass(frozen=True)
class MCExample:
    context: str
    choices: list[str]
    answer: int
    where: str = ""  # FILE:LINE, for errors about this example


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each line, streamed; a FIFO/device is refused, bytes that are not UTF-8 name the line."""
    try:
        f = open_regular(path)
    except OSError as exc:
        raise InvalidInputError(f"task file {path} is unreadable ({exc.strerror or exc})") from None
    with f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInputError(f"{path}:{number} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def read_mc_task(path: str | Path) -> list[MCExample]:
    """Every example of a JSONL task file, each checked (the error names the line and the field)."""
    path = Path(path)
    examples = []
    for number, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except RecursionError:
            raise InvalidInputError(f"{where} is nested too deeply to be a task record") from None
        except ValueError as exc:  # not JSON, or a number too long to convert
            raise InvalidInputError(f"{where} is not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise InvalidInputError(f"{where}: expected an object with context, choices, answer")
        context, choices, answer = record.get("context"), record.get("choices"), record.get("answer")
        if not isinstance(context, str):
            raise InvalidInputError(f"{where}: 'context' must be a string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise InvalidInputError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise InvalidInputError(f"{where}: 'answer' must be the index of a choice (0..{len(choices) - 1})")
        examples.append(MCExample(context, list(choices), answer, where))
    if not examples:
        raise InvalidInputError(f"task file {path} has no examples")
    return examples
