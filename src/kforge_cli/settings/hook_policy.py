"""Which `train.hooks` a command may import: code named by a file needs the user's explicit yes.

A hook is Python code: importing `my_pkg.hooks` runs that module's body before kforge can
check anything about it. Hooks the user typed now (``--train.hooks=...`` or
``KFORGE_TRAIN__HOOKS``) are their own choice. Hooks named by a file (a profile, a
``--config`` file, a run's saved ``config.toml``, which a colleague may have written) are
imported only when ``--allow-hooks`` lists their modules; otherwise the command is refused
(exit 2) before anything is imported, naming the file and the modules. The same consent
covers an lm-eval task YAML's ``!function`` tags (``kforge eval``, ``eval.after_checkpoint``:
:mod:`kforge_cli.settings.task_code`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kforge_cli.errors import InvalidInputError

if TYPE_CHECKING:
    from kforge_cli.settings.config_layers import ResolvedSettings

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
    refuse_unallowed_code(hooks, allowed, what=f"train.hooks from {source}", command=command)


def refuse_unallowed_code(
    specs: Sequence[str],
    allowed: Sequence[str] | None,
    *,
    what: str,
    command: str,
    described: Sequence[str] | None = None,
) -> None:
    """Raise unless ``--allow-hooks`` lists the module of every 'module:name' in `specs` (or the spec itself).

    `what` says which file names the code; `described` (one per spec) says where each would come from.
    """
    ok = parse_allowed(allowed)
    missing = [
        i for i, spec in enumerate(specs) if not {spec, spec.replace(":", "."), spec.partition(":")[0].strip()} & ok
    ]
    if not missing:
        return
    modules = hook_modules(specs[i] for i in missing)
    named = [(described[i] if described else specs[i]) for i in missing]
    raise InvalidInputError(
        f"{command}: {what} names Python code that would be imported and run: "
        + ", ".join(named)
        + f". kforge imports code named by a file only when you allow it (the file may not be yours): "
        f"check the code, then pass {ALLOW_FLAG}={','.join(modules)}"
    )


def allow_flag(hooks: Sequence[str]) -> list[str]:
    """The ``--allow-hooks=...`` argument that lets a child command import ``hooks`` (empty when none)."""
    modules = hook_modules(hooks)
    return [f"{ALLOW_FLAG}={','.join(modules)}"] if modules else []
