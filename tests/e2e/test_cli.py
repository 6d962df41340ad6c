"""The real `kforge` command in a subprocess: help, version, validate-config, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SUBCOMMANDS = ["train", "resume", "convert-mot", "inspect-ckpt", "validate-config", "prepare-data", "export-hf"]


def test_help_lists_subcommands_and_version(kforge) -> None:
    r = kforge("--help")
    assert r.returncode == 0, r.stderr
    for name in SUBCOMMANDS:
        assert name in r.stdout
    v = kforge("--version")
    assert v.returncode == 0 and v.stdout.startswith("kforge ")
    for name in SUBCOMMANDS:
        h = kforge(name, "--help")
        assert h.returncode == 0 and "Usage" in h.stdout, name


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["validate-config", "--profile", "h100x64"],
        ["train", "--help"],
        ["profiles"],
        ["profiles", "show", "h100x64"],
    ],
)
def test_cheap_commands_do_not_import_torch(argv: list[str]) -> None:
    code = (
        "import sys\nfrom kforge_cli.cli.app import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'wandb', 'mlflow') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY=\n" in out, out


def test_every_help_is_free_of_torch_and_the_settings_model() -> None:
    """`kforge --help` and every `kforge SUB --help` stay cheap (bench/cli_startup.py: <= 1.3x a bare Typer app)."""
    code = (
        "import sys\nfrom kforge_cli.cli.app import app, main\n"
        "names = [''] + [c.name for c in app.registered_commands]\n"
        "for g in app.registered_groups:\n"
        "    names += [g.name] + [f'{g.name} {c.name}' for c in g.typer_instance.registered_commands]\n"
        "for name in names:\n"
        "    try:\n        main([*name.split(), '--help'])\n    except SystemExit:\n        pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'pydantic_settings', 'kforge_cli.settings', 'kforge_cli.engine')"
        " if m in sys.modules]\n"
        "print(f'N={len(names)} HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY=\n" in out, out
    assert int(out.split("N=")[1].split()[0]) >= 13, out


def test_sqlite_tracking_without_full_mlflow_exits_2_naming_the_key() -> None:
    """With only mlflow-skinny (sqlalchemy hidden here), a sqlite store is an exit 2 before anything runs."""
    code = (
        "import sys\nsys.modules['sqlalchemy'] = None\nfrom kforge_cli.cli.app import main\n"
        "main(['validate-config', \"--metrics.backends=['mlflow']\", '--metrics.mlflow_tracking_uri=sqlite:///m.db'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "metrics.mlflow_tracking_uri: 'sqlite:///m.db' is a database store" in r.stderr
    assert "pip install 'kforge[mlflow-server]'" in r.stderr and "Traceback" not in r.stderr


def test_validate_h100x64_reports_world_size_64(kforge, data_stub: Path) -> None:
    r = kforge("validate-config", "--profile", "h100x64", f"--data.path={data_stub}")
    assert r.returncode == 0, r.stderr
    assert "world size 64" in r.stdout and "tp=2" in r.stdout


def test_two_mistakes_exit_2_and_name_both_fields(kforge) -> None:
    r = kforge("validate-config", "--model.dim=100", "--model.n_heads=3", "--train.seq_len=4096")
    assert r.returncode == 2
    assert "model.dim" in r.stderr and "train.seq_len" in r.stderr
    assert "Traceback" not in r.stderr


def test_world_size_mismatch_exit_2(kforge, data_stub: Path) -> None:
    data = f"--data.path={data_stub}"
    r = kforge("validate-config", "-p", "h100x64", "--world-size", "48", "--distributed.dp_shard=8", data)
    assert r.returncode == 2 and "world size is 48" in r.stderr and "Traceback" not in r.stderr


def test_user_mistakes_have_no_traceback(kforge, tmp_path: Path) -> None:
    for argv in (
        ["validate-config", "-p", "nope"],
        ["validate-config", "-c", str(tmp_path / "missing.toml")],
        ["validate-config", "--model.dimm=3"],
        ["validate-config", "stray"],
    ):
        r = kforge(*argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, argv


def test_format_and_explain(kforge, tmp_path: Path, data_stub: Path) -> None:
    r = kforge("validate-config", "-p", "h200x32", "--format", "json", f"--data.path={data_stub}")
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data["slurm"]["gpu_type"] == "h200" and data["model"]["dim"] == 5120
    t = kforge("validate-config", "-p", "h200x32", "--format", "toml", f"--data.path={data_stub}")
    (tmp_path / "c.toml").write_text(t.stdout)
    again = kforge("validate-config", "-c", str(tmp_path / "c.toml"), "--format", "json")
    assert json.loads(again.stdout) == data
    e = kforge("validate-config", "-p", "h200x32", "--explain", "model.dim")
    assert e.returncode == 0 and "Hidden size" in e.stdout and "profile h200x32" in e.stdout
