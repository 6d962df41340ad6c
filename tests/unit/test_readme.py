"""The README tells the truth about what ships: every profile, and the VLM data formats the code accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kforge_cli.engine.data.vlm.media import IMAGE_SUFFIXES
from kforge_cli.engine.data.vlm.sources import resolve_records

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def test_every_shipped_profile_is_in_the_readmes_table() -> None:
    table = set(re.findall(r"^\| `([a-z0-9-]+)` \|", README, flags=re.M))
    assert table == {p.stem for p in (ROOT / "profiles").glob("*.toml")}


def test_the_vlm_data_formats_the_readme_shows_are_the_ones_the_code_accepts(tmp_path: Path) -> None:
    section = README[README.index("### Image and video data for VLMs") :].split("\n## ")[0]
    examples = [json.loads(m) for m in re.findall(r"`(\{\"(?:image|video)\".*?\})`", section)]
    assert {next(iter(e)) for e in examples} == {"image", "video"}
    lines = [json.dumps(e) for e in examples]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    _, train, val = resolve_records(str(tmp_path))
    assert [(r.kind, r.path) for r in train] == [(next(iter(e)), tmp_path / next(iter(e.values()))) for e in examples]
    assert val is None
    listed = re.search(r"a scanned directory counts `([^`]+)`", section.replace("\n", " "))
    assert listed is not None and tuple(listed.group(1).split()) == IMAGE_SUFFIXES
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "cat.png").write_bytes(b"")
    (tmp_path / "dir" / "cat.txt").write_text("a cat\n")
    (tmp_path / "dir" / "clip7").mkdir()
    (tmp_path / "dir" / "clip7.txt").write_text("a clip\n")
    _, pairs, _ = resolve_records(str(tmp_path / "dir"))
    assert [(r.kind, r.path.name, r.caption) for r in pairs] == [
        ("image", "cat.png", "a cat"),
        ("video", "clip7", "a clip"),
    ]


def test_the_exit_code_table_lists_every_code_kforge_exits_with() -> None:
    from kforge_cli import errors

    table = {int(code) for code in re.findall(r"^\| (\d+) \|", README, flags=re.M)}
    constants = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert constants | {130} == table
