"""Multiple-choice tasks from local JSONL: one ``{"context", "choices", "answer"}`` object per line.

``answer`` is the index of the right choice. Each choice is scored as the
log-likelihood of its tokens after the context's (the continuation is appended as
written, so put the separating space at the start of each choice, as lm-evaluation-harness does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.errors import InvalidInputError


@dataclass(frozen=True)
class MCExample:
    context: str
    choices: list[str]
    answer: int


def read_mc_task(path: str | Path) -> list[MCExample]:
    """Every example of a JSONL task file, each checked (the error names the line and the field)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"task file {path} is unreadable ({exc})") from exc
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{where} is not JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise InvalidInputError(f"{where}: expected an object with context, choices, answer")
        context, choices, answer = record.get("context"), record.get("choices"), record.get("answer")
        if not isinstance(context, str):
            raise InvalidInputError(f"{where}: 'context' must be a string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise InvalidInputError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise InvalidInputError(f"{where}: 'answer' must be the index of a choice (0..{len(choices) - 1})")
        examples.append(MCExample(context, list(choices), answer))
    if not examples:
        raise InvalidInputError(f"task file {path} has no examples")
    return examples
