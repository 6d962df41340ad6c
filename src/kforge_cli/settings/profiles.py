"""Finding and reading profiles: `profiles/NAME.toml` with `extends = "other"` inheritance."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.common.files import read_toml_file
from kforge_cli.errors import InvalidInputError

DEFAULT_PROFILE = "cpu-debug"
PROFILE_ONLY_KEYS = ("extends", "description")


SHIPPED = "shipped"
PROJECT = "./profiles"
ENV_PATH = "$KFORGE_PROFILE_PATH"


def profile_sources() -> list[tuple[Path, str]]:
    """Where profiles are looked up, first match wins, each with where it comes from.

    ``$KFORGE_PROFILE_PATH`` (colon-separated), ``./profiles`` (a project's own), then
    the profiles shipped with kforge (the repository's ``profiles/`` in a source checkout,
    ``kforge_cli/_profiles`` in an installed wheel).
    """
    found = [(Path(p), ENV_PATH) for p in os.environ.get("KFORGE_PROFILE_PATH", "").split(os.pathsep) if p]
    found.append((Path.cwd() / "profiles", PROJECT))
    package_dir = Path(__file__).resolve().parent.parent
    found.append((package_dir / "_profiles", SHIPPED))
    found.append((package_dir.parent.parent / "profiles", SHIPPED))
    shipped_dirs = {_real(d) for d, source in found if source == SHIPPED}
    unique: list[tuple[Path, str]] = []
    for d, source in found:
        if all(_real(d) != _real(seen) for seen, _ in unique):
            # a source checkout run from its root: ./profiles *is* the shipped directory
            unique.append((d, SHIPPED if _real(d) in shipped_dirs else source))
    return unique


def _real(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


def profile_dirs() -> list[Path]:
    """The directories of :func:`profile_sources`, in lookup order."""
    return [d for d, _ in profile_sources()]


def available_profiles() -> list[str]:
    names = {p.stem for d in profile_dirs() if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


@dataclass(frozen=True)
class ProfileEntry:
    """One profile `--profile NAME` finds: its file, where that comes from, and what it says it is."""

    name: str
    path: Path
    source: str  # SHIPPED, PROJECT or ENV_PATH
    description: str
    extends: str | None
    shadows: tuple[Path, ...]  # files of the same name further down the lookup order (not used)


def list_profiles() -> list[ProfileEntry]:
    """Every profile name kforge can find, with the file that wins; a file that does not parse says so."""
    files: dict[str, list[tuple[Path, str]]] = {}
    for d, source in profile_sources():
        if d.is_dir():
            for path in sorted(d.glob("*.toml")):
                files.setdefault(path.stem, []).append((path, source))
    entries = []
    for name in sorted(files):
        (path, source), *rest = files[name]
        try:
            data = read_toml(path, "profile")
            description, parent = str(data.get("description", "")), data.get("extends")
        except InvalidInputError as exc:
            description, parent = f"(unreadable: {exc})", None
        extends = parent if isinstance(parent, str) else None
        entries.append(ProfileEntry(name, path, source, description, extends, tuple(p for p, _ in rest)))
    return entries


PATH_GIVEN = "a path given"


@dataclass(frozen=True)
class ProfileFile:
    """The file a profile name resolved to, where it comes from, and the shipped file it shadows (if any)."""

    name: str
    path: Path
    source: str  # SHIPPED, PROJECT, ENV_PATH or PATH_GIVEN
    shadows_shipped: Path | None = None

    def describe(self) -> str:
        where = f"{self.path} ({self.source})"
        if self.shadows_shipped is not None:
            where += f", SHADOWING the shipped {self.shadows_shipped}"
        return where


def locate_profile(name: str) -> ProfileFile:
    """Where profile NAME comes from (NAME itself when it is a path to a .toml file).

    A file in ./profiles that has the name of a shipped profile is refused: a directory one
    happens to run in (a colleague's project, a cloned repository) must not silently replace
    a profile kforge ships, which can set checkpoint.dir, train.hooks or slurm.setup lines.
    The user's own ``$KFORGE_PROFILE_PATH`` may shadow one; the resolution says so loudly.
    """
    if name.endswith(".toml"):
        path = Path(name)
        if not path.is_file():
            raise InvalidInputError(f"profile file {name} does not exist")
        return ProfileFile(path.stem, path, PATH_GIVEN)
    hits = [(d / f"{name}.toml", source) for d, source in profile_sources() if (d / f"{name}.toml").is_file()]
    if not hits:
        known = ", ".join(available_profiles()) or "none found"
        raise InvalidInputError(f"unknown profile {name!r}; available profiles: {known}")
    (path, source), rest = hits[0], hits[1:]
    shipped = next((p for p, s in rest if s == SHIPPED), None)
    if shipped is not None and source == PROJECT:
        raise InvalidInputError(
            f"profile {name!r}: {path} (in the working directory's ./profiles) has the name of the profile kforge "
            f"ships ({shipped}) and would silently replace it. Rename that file, or use it deliberately by path: "
            f"--profile {path}"
        )
    return ProfileFile(name, path, source, shipped)


def find_profile(name: str) -> Path:
    """The file of profile NAME (or NAME itself when it is a path to a .toml file); see :func:`locate_profile`."""
    return locate_profile(name).path


def profile_chain(name: str) -> list[ProfileFile]:
    """Profile NAME's file and those of everything it extends, each with where it comes from."""
    chain: list[ProfileFile] = []
    while True:
        entry = locate_profile(name)
        if any(entry.path == e.path for e in chain):
            raise InvalidInputError(f"profile inheritance cycle through {entry.path}")
        chain.append(entry)
        parent = read_toml(entry.path, "profile").get("extends")
        if not isinstance(parent, str):
            return chain
        name = parent


def read_toml(path: Path, what: str) -> dict[str, object]:
    """Parse a TOML file; a syntax error names the file and line (see ``files.read_toml_file``)."""
    return read_toml_file(path, what)


def load_profile(name: str, _chain: tuple[str, ...] = ()) -> tuple[dict[str, object], Path]:
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
    try:
        find_profile(parent)
    except InvalidInputError as exc:  # a typo in `extends =`: say which file holds it
        raise InvalidInputError(f"profile {path}: extends = {parent!r}: {exc}") from None
    base, _ = load_profile(parent, (*_chain, name))
    return deep_merge(base, data), path


def extends_chain(name: str) -> list[Path]:
    """The files profile NAME is built from, itself first, then what it extends (a cycle is an error)."""
    chain: list[Path] = []
    while True:
        path = find_profile(name)
        if path in chain:
            raise InvalidInputError(f"profile inheritance cycle through {path}")
        chain.append(path)
        parent = read_toml(path, "profile").get("extends")
        if not isinstance(parent, str):
            return chain
        name = parent


def deep_merge(base: dict[str, object], top: dict[str, object]) -> dict[str, object]:
    """Merge nested dicts; values in `top` win, dicts merge recursively, lists replace."""
    out = dict(base)
    for key, value in top.items():
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            out[key] = deep_merge(current, value)
        else:
            out[key] = value
    return out
