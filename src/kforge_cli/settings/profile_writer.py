"""A profile file from resolved settings: what differs from the profile they extend (torch-free).

Used by ``kforge plan search --write-profile FILE``: the file says ``extends = BASE``
and holds every value the resolved settings have that BASE alone does not give (the layout,
and the command line's overrides), so ``kforge plan --profile FILE`` resolves to
the same settings with nothing else on the command line.
"""

from __future__ import annotations

from pathlib import Path

import tomli_w

from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.profiles import DEFAULT_PROFILE

NOT_WRITTEN = ("profile",)  # set by the loader from the profile's name


def _diff(current: dict[str, object], base: dict[str, object], where: str = "") -> dict[str, object]:
    """The keys of ``current`` (a settings dump) whose values differ from ``base``'s, sections recursed."""
    out: dict[str, object] = {}
    for key, value in current.items():
        if not where and key in NOT_WRITTEN:
            continue
        ref = base.get(key)
        if isinstance(value, dict) and isinstance(ref, dict):
            sub = _diff(value, ref, f"{where}{key}.")
            if sub:
                out[key] = sub
        elif value != ref:
            if value is None:
                raise InvalidInputError(
                    f"cannot write {where}{key} = None into a profile (TOML has no null) over its value {ref!r} "
                    f"in the profile it extends; set it in the written file by hand"
                )
            out[key] = value
    return out


def extends_name(settings: JobSettings) -> str:
    """What the written profile extends: the profile's name, or the absolute path of a profile given by path."""
    name = settings.profile or DEFAULT_PROFILE
    return str(Path(name).resolve()) if name.endswith(".toml") else name


def profile_toml(settings: JobSettings, base: JobSettings, description: str, comment: list[str]) -> str:
    """The text of a profile that extends ``base``'s profile and resolves to ``settings``."""
    current, ref = settings.model_dump(mode="json"), base.model_dump(mode="json")
    body = {"description": description, "extends": extends_name(settings), **_diff(current, ref)}
    head = "".join(f"# {line}\n" for line in comment)
    return head + tomli_w.dumps(body)
