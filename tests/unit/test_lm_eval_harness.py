"""lm-evaluation-harness for real: kforge's adapter and the harness's own ``hf`` backend agree.

A local task (tests/data/lm_eval: a YAML and a JSONL, nothing downloaded) is scored by
``kforge eval --task lm-eval:TASK.yaml`` on a checkpoint and by lm-eval's ``HFLM`` on the
checkpoint's ``export-hf`` directory: the same examples, every log-likelihood within
1e-4, the same accuracies. Skipped without lm_eval (``pip install 'kforge[lm-eval]'``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kforge_cli.engine.evaluation.lm_eval_adapter import make_adapter, task_config, task_manager
from kforge_cli.engine.interop.open_checkpoint import open_for_inference
from tests.helpers.tiny import model

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the harness's hf backend needs it

TASK = Path(__file__).resolve().parent.parent / "data" / "lm_eval" / "kforge_tiny_mc.yaml"
TINY = [
    *model(32, 2, 4, 2, max_seq_len=64),
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--train.max_steps=3",
    "--train.num_threads=1",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=0",
]
LL_TOL = 1e-4


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kforge_cli.engine.train import run_training
    from kforge_cli.settings import load_settings

    out = tmp_path_factory.mktemp("lm_eval") / "run"
    settings = load_settings(overrides=[*TINY, f"--train.run_dir={out}"], use_env=False).settings
    assert run_training(settings).status == "completed"
    return out


def logliks(result: dict) -> dict[int, list[float]]:
    """doc id -> the log-likelihood of each choice, from ``simple_evaluate(..., log_samples=True)``."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in result["samples"]["kforge_tiny_mc"]}


def test_kforge_eval_and_the_harness_hf_backend_on_the_export_agree(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from kforge_cli.cli.app import main
    from kforge_cli.engine.interop.hf_export import export_hf

    with pytest.raises(SystemExit) as done:  # the command a user runs
        main(["eval", str(run_dir), "--task", f"lm-eval:{TASK}", "--json", "--no-log"])
    assert done.value.code == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]["kforge_tiny_mc"]
    assert cli["examples"] == 24

    loaded = open_for_inference(run_dir)
    config = task_config(TASK)
    index = task_manager(config)
    ours = simple_evaluate(
        model=make_adapter(loaded), tasks=[config], task_manager=index, bootstrap_iters=0, log_samples=True
    )
    hf_dir = export_hf(loaded.path, tmp_path / "hf").out_dir
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=1)
    theirs = simple_evaluate(model=hf, tasks=[config], task_manager=index, bootstrap_iters=0, log_samples=True)
    assert ours is not None and theirs is not None

    a, b = logliks(ours), logliks(theirs)
    assert sorted(a) == sorted(b) == list(range(24))
    worst = max(abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True))
    acc = {k: ours["results"]["kforge_tiny_mc"][f"{k},none"] for k in ("acc", "acc_norm")}
    acc_hf = {k: theirs["results"]["kforge_tiny_mc"][f"{k},none"] for k in ("acc", "acc_norm")}
    print(
        f"lm-eval kforge_tiny_mc, 24 examples: kforge acc {acc['acc']:.4f} acc_norm {acc['acc_norm']:.4f}; "
        f"hf backend on the export acc {acc_hf['acc']:.4f} acc_norm {acc_hf['acc_norm']:.4f}; "
        f"largest log-likelihood difference {worst:.2e}"
    )
    assert worst <= LL_TOL
    assert acc == acc_hf
    assert (cli["acc"], cli["acc_norm"]) == (acc["acc"], acc["acc_norm"])


def test_a_missing_task_yaml_is_a_clear_error(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kforge_cli.cli.app import main

    with pytest.raises(SystemExit) as done:
        main(["eval", str(run_dir), "--task", "lm-eval:no/such/task.yaml", "--no-log"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "no/such/task.yaml does not exist" in err and "Traceback" not in err
