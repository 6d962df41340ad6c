"""bench/attention_speed.py's CPU smoke mode: the GPU acceptance script can rely on its output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _bench():
    spec = importlib.util.spec_from_file_location("attention_speed", REPO / "bench" / "attention_speed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_mode_runs_every_backend_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench = _bench()
    out = tmp_path / "speed.json"
    result = bench.run(bench.parse(["--smoke", "--out", str(out)]))
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved["backends"]) == {"flex", "sdpa_dense", "sdpa_causal"}
    assert all(r["tokens_per_s"] > 0 for r in saved["backends"].values())
    assert saved["seq_len"] == 256 and saved["documents"] >= 3  # packed: several documents per sequence
    assert saved["flex_over_dense"] == pytest.approx(
        saved["backends"]["flex"]["tokens_per_s"] / saved["backends"]["sdpa_dense"]["tokens_per_s"]
    )
    assert "flex / dense-mask SDPA tokens/s" in capsys.readouterr().out


def test_packed_documents_restart_positions() -> None:
    docs, pos = _bench().packed_documents(2, 500, 64, seed=0)
    starts = docs[:, 1:] != docs[:, :-1]
    assert (pos[:, 1:][starts] == 0).all() and (pos[:, 0] == 0).all()
    assert (pos[:, 1:][~starts] == pos[:, :-1][~starts] + 1).all()
