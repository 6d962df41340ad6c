"""The generated reference pages and the README's command table match the code they come from.

`python tools/docs_reference.py` regenerates them; these tests fail when someone changes a
setting, a profile or a command's help and forgets to (the message says which command to run).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from kforge_cli.settings import JobSettings
from kforge_cli.settings.training import ModelSettings

ROOT = Path(__file__).parents[2]


def _load_tool() -> types.ModuleType:
    """tools/docs_reference.py (a developer script, not part of the installed package)."""
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "tools" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_reference"] = module  # dataclasses and typing resolve the module by name
    spec.loader.exec_module(module)
    return module


ref = _load_tool()


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        keys.append(key)
        section = ref._section_of(info.annotation)
        if section is not None:
            keys += _dotted_keys(section, key)
    return keys


def test_the_checked_in_pages_are_what_the_code_generates() -> None:
    stale = ref.stale_files(ROOT)
    assert not stale, f"stale: {[str(p.relative_to(ROOT)) for p in stale]}; run `{ref.REGENERATE}`"


def test_a_changed_field_description_makes_the_configuration_page_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    info = ModelSettings.model_fields["dim"]
    monkeypatch.setattr(info, "description", "Width of the residual stream (changed without regenerating).")
    assert ref.stale_files(ROOT) == [ROOT / ref.CONFIG_PAGE]
    assert "changed without regenerating" in ref.configuration_reference()


def test_every_setting_has_a_row_with_its_type_default_and_description() -> None:
    page = (ROOT / ref.CONFIG_PAGE).read_text()
    headings = list(re.finditer(r"^#+ (.+?)(?: \{ #.*)?$", page, flags=re.M))
    blocks = {m.group(1): page[m.end() : n.start()] for m, n in itertools.pairwise(headings)}
    keys = _dotted_keys(JobSettings)
    assert len(keys) > 200
    missing = []
    for key in keys:
        parent, _, name = key.rpartition(".")
        if not parent and key in blocks:  # a top-level section: its own heading and table
            continue
        row = r"^\| `" + re.escape(name) + r"` \| ([^|]+) \| ([^|]+) \| (.+) \|$"
        if not re.search(row, blocks.get(parent, "") if parent else page, flags=re.M):
            missing.append(key)
    assert not missing
    dim = re.search(r"^\| `dim` \| int > 0 \| `256` \| Hidden size of the residual stream\. \|$", page, flags=re.M)
    assert dim is not None
    norm = re.search(r'^\| `norm` \| one of `"rmsnorm"`, `"layernorm"` \| `"rmsnorm"` \|', page, flags=re.M)
    assert norm is not None


def test_every_shipped_profile_is_listed_with_what_it_sets() -> None:
    page = (ROOT / ref.CONFIG_PAGE).read_text()
    profiles = sorted(p.stem for p in (ROOT / "profiles").glob("*.toml"))
    assert re.findall(r"^### ([a-z0-9-]+)$", page, flags=re.M) == profiles
    h100x64 = page[page.index("### h100x64\n") :].split("\n### ")[0]
    assert "Extends [`h100x8`](#h100x8)" in h100x64
    assert "distributed.tp = 2" in h100x64 and "slurm.nodes = 8" in h100x64


def test_the_readme_table_lists_every_subcommand_with_its_help() -> None:
    import typer.main

    from kforge_cli.cli.app import app

    readme = (ROOT / "README.md").read_text()
    names = re.findall(r"^\| `kforge ([a-z -]+)` \| (.+) \|$", readme, flags=re.M)
    group = typer.main.get_command(app)
    assert [n for n, _ in names if " " not in n] == list(group.commands)  # type: ignore[attr-defined]
    train_help = dict(names)["train"]
    assert train_help == "Train a model. With no arguments: the cpu-debug profile on the built-in corpus."


def test_types_read_as_a_person_would_write_them() -> None:
    assert ref.type_text(int | None, []) == "int or unset"
    assert ref.type_text(typing.Literal["a", "b"]) == 'one of `"a"`, `"b"`'
    assert ref.type_text(list[str]) == "list of str"
    assert ref.type_text(dict[str, str]) == "table of str -> str"
    betas = JobSettings.model_fields["optimizer"].annotation.model_fields["betas"]  # type: ignore[union-attr]
    assert ref.type_text(betas.annotation) == "[float, float] each >= 0, < 1"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict` (also in .ci/run): a broken link, anchor or a page missing from the nav fails."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
