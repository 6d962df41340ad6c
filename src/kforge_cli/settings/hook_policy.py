"""Which `train.hooks` a command may import: code named by a file needs the user's explicit yes.

A hook is Python code: importing `my_pkg.hooks` runs that module's body before kforge can
check anything about it. Hooks the user typed now (``--train.hooks=...`` or
``KFORGE_TRAIN__HOOKS``) are their own choice. Hooks named by a file (a profile, a
``--config`` file, a run's saved ``config.toml``, which a colleague may have written) are
imported only when ``--allow-hooks`` lists their modules; otherwise the command is refused
(exit 2) before anything is imported, naming the file and the modules. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kforge_cli.errors import InvalidInputError

if TYPE_CHECKING:
    from kforge_cli.settings.loader import ResolvedSettings

ALLOW_FLAG = "--allow-hooks"
_TYPED_NOW = ("command line", "env ")


def hook_modules(specs: Iterable[str]) -> list[str]:
    """The module of each 'package.module:ClassName', in order, each once."""
    out: list[str] = []
    for spec in specs:
        module = spec.partition(":")[0].strip()
        if module and module not in out:
            out.append(module)
    return out


def parse_allowed(values: Sequence[str] | None) -> set[str]:
    """``--allow-hooks a.b,c.d --allow-hooks e`` -> {'a.b', 'c.d', 'e'} (module names or full specs)."""
    return {part.strip() for value in values or () for part in value.split(",") if part.strip()}


def refuse_unallowed_hooks(resolved: ResolvedSettings, allowed: Sequence[str] | None, command: str) -> None:
    """Raise unless every hook named by a file is allowed by ``--allow-hooks`` (see the module docstring)."""
    hooks = list(resolved.settings.train.hooks)
    if not hooks:
        return
    source = resolved.source_of("train.hooks")
    if source.startswith(_TYPED_NOW):
        return
    ok = parse_allowed(allowed)
    missing = [spec for spec in hooks if spec not in ok and spec.partition(":")[0].strip() not in ok]
    if not missing:
        return
    modules = hook_modules(missing)
    raise InvalidInputError(
        f"{command}: train.hooks from {source} names Python code that would be imported and run: "
        + ", ".join(missing)
        + ". kforge imports hooks named by a file only when you allow them (the file may not be yours): "
        f"check the code, then pass {ALLOW_FLAG}={','.join(modules)}"
    )


def allow_flag(hooks: Sequence[str]) -> list[str]:
    """The ``--allow-hooks=...`` argument that lets a child command import ``hooks`` (empty when none)."""
    modules = hook_modules(hooks)
    return [f"{ALLOW_FLAG}={','.join(modules)}"] if modules else []
