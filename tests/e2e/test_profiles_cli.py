"""`kforge profiles` and `kforge profiles show NAME` through the real command; a typo in `extends =`."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tests.conftest import run_kforge

pytestmark = pytest.mark.e2e

SHIPPED = Path(__file__).parents[2] / "profiles"


def test_profiles_lists_every_profile_with_its_description_and_where_it_comes_from(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "mine.toml").write_text('description = "my own"\nextends = "cpu-debug"\n')
    site = tmp_path / "site"
    site.mkdir()
    (site / "cpu-debug.toml").write_text('description = "the site\'s tiny model"\n[model]\ndim = 64\n')
    r = run_kforge("profiles", "--json", cwd=tmp_path, env={"KFORGE_PROFILE_PATH": str(site)}, timeout=120)
    assert r.returncode == 0, r.stderr
    listed = {e["name"]: e for e in map(json.loads, r.stdout.splitlines())}
    assert {p.stem for p in SHIPPED.glob("*.toml")} | {"mine"} == set(listed)
    assert (listed["mine"]["source"], listed["mine"]["description"], listed["mine"]["extends"]) == (
        "./profiles",
        "my own",
        "cpu-debug",
    )
    site_debug = listed["cpu-debug"]
    assert site_debug["source"] == "$KFORGE_PROFILE_PATH" and site_debug["path"] == str(site / "cpu-debug.toml")
    assert site_debug["shadows"] == [str(SHIPPED / "cpu-debug.toml")]
    assert listed["llama70b-h100x64"]["source"] == "shipped"
    assert "Llama-3-70B" in listed["llama70b-h100x64"]["description"]
    table = run_kforge("profiles", cwd=tmp_path, env={"KFORGE_PROFILE_PATH": str(site)}, timeout=120)
    assert table.returncode == 0 and "mine" in table.stdout and "my own" in table.stdout
    assert f"[$KFORGE_PROFILE_PATH ({site}), {site / 'cpu-debug.toml'}; shadows " in table.stdout


def test_profiles_show_prints_the_resolved_toml_and_the_files_it_came_from() -> None:
    r = run_kforge("profiles", "show", "h100x64", timeout=120)
    assert r.returncode == 0, r.stderr
    header = [line for line in r.stdout.splitlines() if line.startswith("#")]
    assert header == [
        f"# profile h100x64: {SHIPPED / 'h100x64.toml'}",
        f"#   extends h100x8: {SHIPPED / 'h100x8.toml'}",
    ]
    shown = tomllib.loads(r.stdout)
    assert shown["model"]["dim"] == 4096  # from h100x8
    assert shown["slurm"]["nodes"] == tomllib.loads((SHIPPED / "h100x64.toml").read_text())["slurm"]["nodes"]
    assert "extends" not in shown and "description" not in shown
    missing = run_kforge("profiles", "show", "h100x9", timeout=120)
    assert missing.returncode == 2 and "unknown profile 'h100x9'" in missing.stderr


def test_a_typo_in_extends_names_the_file_that_holds_it(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    typo = tmp_path / "profiles" / "big.toml"
    typo.write_text('extends = "h100x9"\n[train]\nmax_steps = 10\n')
    for argv in (["validate-config", "-p", "big"], ["profiles", "show", "big"]):
        r = run_kforge(*argv, cwd=tmp_path, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"profile {typo}: extends = 'h100x9': unknown profile 'h100x9'" in r.stderr, r.stderr
