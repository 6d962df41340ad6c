"""Finding and reading profiles: `profiles/NAME.toml` with `extends = "other"` inheritance."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from kforge_cli.errors import InvalidInputError

DEFAULT_PROFILE = "cpu-debug"
PROFILE_ONLY_KEYS = ("extends", "description")


def profile_dirs() -> list[Path]:
    """Where profiles are looked up, first match wins.

    ``$KFORGE_PROFILE_PATH`` (colon-separated), ``./profiles`` (a project's own), then
    the profiles shipped with kforge (the repository's ``profiles/`` in a source checkout,
    ``kforge_cli/_profiles`` in an installed wheel).
    """
    dirs = [Path(p) for p in os.environ.get("KFORGE_PROFILE_PATH", "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "profiles")
    package_dir = Path(__file__).resolve().parent.parent
    dirs.append(package_dir / "_profiles")
    dirs.append(package_dir.parent.parent / "profiles")
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def available_profiles() -> list[str]:
    names = {p.stem for d in profile_dirs() if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def find_profile(name: str) -> Path:
    """The file of profile NAME (or NAME itself when it is a path to a .toml file)."""
    if name.endswith(".toml"):
        path = Path(name)
        if not path.is_file():
            raise InvalidInputError(f"profile file {name} does not exist")
        return path
    for d in profile_dirs():
        candidate = d / f"{name}.toml"
        if candidate.is_file():
            return candidate
    known = ", ".join(available_profiles()) or "none found"
    raise InvalidInputError(f"unknown profile {name!r}; available profiles: {known}")


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; a syntax error names the file and line."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InvalidInputError(f"{what} {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"{what} {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise InvalidInputError(f"cannot read {what} {path}: {exc.strerror}") from None


def load_profile(name: str, _chain: tuple[str, ...] = ()) -> tuple[dict[str, Any], Path]:
    """The profile's settings with its `extends` chain merged in (child wins)."""
    if name in _chain:
        cycle = " -> ".join((*_chain, name))
        raise InvalidInputError(f"profile inheritance cycle: {cycle}")
    path = find_profile(name)
    data = read_toml(path, "profile")
    parent = data.get("extends")
    for key in PROFILE_ONLY_KEYS:
        data.pop(key, None)
    if parent is None:
        return data, path
    if not isinstance(parent, str):
        raise InvalidInputError(f"profile {path}: 'extends' must be a profile name")
    base, _ = load_profile(parent, (*_chain, name))
    return deep_merge(base, data), path


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge nested dicts; values in `top` win, dicts merge recursively, lists replace."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
