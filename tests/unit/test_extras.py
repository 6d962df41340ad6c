"""A lighter install: trackers and plots are extras, and a missing one is an exit 2 with its install command."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from tests.conftest import REPO


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name in modules else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_install_has_no_tracker_or_plot_package_and_the_extras_name_them() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in project["dependencies"]}
    assert not names & {"wandb", "mlflow-skinny", "mlflow", "matplotlib"}
    extras = project["optional-dependencies"]
    assert (extras["wandb"], extras["mlflow"], extras["plot"]) == (
        ["wandb>=0.17"],
        ["mlflow-skinny>=2.14"],
        ["matplotlib>=3.7"],
    )
    assert extras["all"] == ["kforge[wandb,mlflow,plot,tensorboard,hf]"]
    assert extras["dev"][0].startswith("kforge[all,")


@pytest.mark.parametrize(
    ("backend", "module"), [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")]
)
def test_a_tracker_without_its_package_exits_2_with_the_install_command(
    backend: str, module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _without(monkeypatch, module)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--run-dir", str(tmp_path / "run"), f'--metrics.backends=["jsonl","{backend}"]'])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert f"metrics.backends: '{backend}' needs the {module} package, which is not installed: " in err
    assert f"run `pip install 'kforge[{backend}]'`" in err
    assert not (tmp_path / "run").exists()


def test_the_tracker_build_refuses_a_missing_package_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kforge_cli.engine.observe.tracker import run_info, tracker_backends
    from kforge_cli.errors import ConfigError
    from kforge_cli.settings import load_settings

    settings = load_settings(overrides=['--metrics.backends=["wandb"]'], use_env=False).settings
    _without(monkeypatch, "wandb")
    with pytest.raises(ConfigError, match=r"pip install 'kforge\[wandb\]'"):
        tracker_backends(settings.metrics, run_info(settings, tmp_path, 1), {})


def test_plot_without_matplotlib_exits_2_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _without(monkeypatch, "matplotlib")
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "kforge plot draws with matplotlib, which is not installed: pip install 'kforge[plot]'" in err, err
