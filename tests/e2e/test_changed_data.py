"""The data a run trains on is checked on resume; prepare-data never replaces other data silently (issue 41).

The repro: `prepare-data corpus --out D`, train on D and stop, add one record to the corpus and
run `prepare-data` again: it rewrote D without `--overwrite`, and `kforge resume` continued on
the changed shards with no word. Now the second `prepare-data` is refused without
`--overwrite`, and a resume on the re-prepared data is refused naming the fingerprint the
checkpoint recorded and the data's now, unless the command allows it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from tests.e2e.test_second_command import TINY, snapshot
from tests.helpers.launch import with_repo_path

pytestmark = pytest.mark.e2e

ENV = with_repo_path(os.environ)
FINGERPRINT = re.compile(r"sha256:[0-9a-f]{16}")


def _prepare(capsys: pytest.CaptureFixture[str], text: Path, out: Path, *extra: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare-data", str(text), "--out", str(out), "--quiet", "--workers", "1", *extra])
    return int(exit_info.value.code or 0), capsys.readouterr().err


def test_re_prepared_data_is_refused_by_prepare_data_and_by_resume_naming_both_fingerprints(
    kforge, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, data, run = tmp_path / "corpus.txt", tmp_path / "data", tmp_path / "run"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    assert _prepare(capsys, text, data)[0] == 0
    assert _prepare(capsys, text, data)[0] == 0  # unchanged inputs: a no-op, not a refusal
    r = kforge("train", f"--data.path={data}", "--train.max_steps=2", "--run-dir", str(run), *TINY, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((run / "checkpoints" / "step_2" / "train_state.json").read_text())
    [trained_on] = state["data"]["dataset_fingerprints"]
    assert FINGERPRINT.fullmatch(trained_on)

    with text.open("a") as f:
        f.write("one more record, as in the issue.\n")
    data_before = snapshot(data)
    code, err = _prepare(capsys, text, data)
    assert code == 2 and f"--out {data} holds data prepared from other inputs" in err and "--overwrite" in err, err
    assert snapshot(data) == data_before  # not replaced
    assert _prepare(capsys, text, data, "--overwrite")[0] == 0

    run_before = snapshot(run)
    r = kforge("resume", str(run), "--train.max_steps=4", env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    [now] = {p for p in FINGERPRINT.findall(r.stderr) if p != trained_on}
    assert f"the checkpoint trained on data with fingerprint {trained_on}; the data now has fingerprint {now}" in (
        r.stderr
    ), r.stderr[-3000:]
    assert "--data.allow_changed_data=true" in r.stderr
    assert snapshot(run) == run_before  # refused before anything was written

    r = kforge("resume", str(run), "--train.max_steps=4", "--data.allow_changed_data=true", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"continuing on changed data (data.allow_changed_data): the checkpoint trained on {trained_on}" in r.stderr
    [change] = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert change["changes"] == {"train.max_steps": {"from": 2, "to": 4}}  # the allowance is one command's
    state = json.loads((run / "checkpoints" / "step_4" / "train_state.json").read_text())
    assert state["data"]["dataset_fingerprints"] == [now]


def test_the_loader_refuses_a_checkpoint_of_other_data_naming_both_fingerprints() -> None:
    """The engine's own check (any caller of `run_training`, not only the CLI)."""
    from kforge_cli.engine.data.loader import DataStateError, StatefulLoader
    from kforge_cli.engine.data.mixture import MixtureSchedule
    from kforge_cli.engine.data.sampler import SampleOrder

    def loader(prints: list[str], *, allow: bool = False) -> StatefulLoader:
        schedule = MixtureSchedule.build(["d"], [1.0], 1.0)
        order = SampleOrder(["d"], [10], schedule, seed=1, batch_size=2, dp_rank=0, dp_size=1)
        return StatefulLoader(order, lambda a, b: {}, seq_len=8, fingerprints=prints, allow_changed_data=allow)

    state = loader(["sha256:aaaa"]).state_dict()
    with pytest.raises(DataStateError, match="fingerprint sha256:aaaa; the data now has fingerprint sha256:bbbb"):
        loader(["sha256:bbbb"]).load_state_dict(state)
    loader(["sha256:bbbb"], allow=True).load_state_dict(state)  # allowed: continues at the same position
    loader(["sha256:aaaa"]).load_state_dict(state)
    del state["dataset_fingerprints"]  # a checkpoint from before fingerprints: the other checks only
    loader(["sha256:bbbb"]).load_state_dict(state)
