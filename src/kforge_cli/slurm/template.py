"""Finding and filling the sbatch template (`slurm/job.sbatch.tmpl`).

The template is a bash script, so it cannot use `$name` or `{name}` placeholders without
escaping every shell expansion in it; placeholders are `{{name}}` instead. Filling is
strict about unknown placeholders (a typo in a site's template must not become a silent
blank) and lenient about unused values (a site's template may leave some out).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kforge_cli.errors import InvalidInputError

DEFAULT_TEMPLATE = "job.sbatch.tmpl"
_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_][a-z0-9_]*)\s*\}\}")


def template_dirs() -> list[Path]:
    """Where templates are looked up, first match wins.

    ``$KFORGE_SLURM_TEMPLATE_PATH`` (colon-separated, a site's own template), then the
    template shipped with kforge: ``kforge_cli/_slurm`` in an installed wheel, the
    repository's ``slurm/`` in a source checkout.
    """
    dirs = [Path(p) for p in os.environ.get("KFORGE_SLURM_TEMPLATE_PATH", "").split(os.pathsep) if p]
    package_dir = Path(__file__).resolve().parent.parent
    dirs.append(package_dir / "_slurm")
    dirs.append(package_dir.parent.parent / "slurm")
    return dirs


def find_template(name: str = DEFAULT_TEMPLATE) -> Path:
    """The template file `name` from the first directory of :func:`template_dirs` that has it."""
    for d in template_dirs():
        candidate = d / name
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(d) for d in template_dirs())
    raise InvalidInputError(
        f"sbatch template {name} not found (searched {searched}); reinstall kforge or set KFORGE_SLURM_TEMPLATE_PATH"
    )


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


def fill(text: str, values: dict[str, str], source: Path | str = "template") -> str:
    """Replace every `{{name}}` in `text` with `values[name]`; an unknown name is an error naming `source`."""
    unknown = sorted(placeholders(text) - values.keys())
    if unknown:
        known = ", ".join(sorted(values))
        raise InvalidInputError(
            f"sbatch template {source}: unknown placeholder(s) {', '.join(unknown)}; known: {known}"
        )
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
