"""JobSettings: layered sources and precedence, unknown keys, validation rules, profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from kforge_cli.errors import ConfigError, InvalidInputError
from kforge_cli.settings import JobSettings, load_settings, parse_overrides, resolve_dims
from kforge_cli.settings.explain import explain_key, to_toml
from kforge_cli.settings.profiles import available_profiles

SHIPPED = [
    "cpu-debug",
    "h100x8",
    "h100x8-32k-cp",
    "h100x64",
    "h200x8",
    "h200x32",
    "vlm-mot-debug",
    "moe-debug",
    "moe16b-h100x8",
    "moe16b-h100x64",
]


@pytest.fixture
def profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "base.toml").write_text(
        "[train]\nmax_steps = 10\nseq_len = 64\n[model]\ndim = 64\n[scheduler]\nwarmup_steps = 2\n"
    )
    (d / "child.toml").write_text('extends = "base"\n[train]\nmax_steps = 11\n')
    (d / "loop-a.toml").write_text('extends = "loop-b"\n')
    (d / "loop-b.toml").write_text('extends = "loop-a"\n')
    monkeypatch.setenv("KFORGE_PROFILE_PATH", str(d))
    for key in [k for k in __import__("os").environ if k.startswith("KFORGE_") and "__" in k]:
        monkeypatch.delenv(key)
    return d


def test_precedence_each_level_wins_over_the_one_below(
    profile_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "job.toml"
    cfg.write_text("[train]\nmax_steps = 20\n")
    assert load_settings().settings.train.max_steps == 300  # default profile cpu-debug
    assert JobSettings().train.max_steps == 1000  # the model's own default
    r = load_settings("child")
    assert r.settings.train.max_steps == 11 and r.source_of("train.max_steps").startswith("profile child")
    assert r.settings.train.seq_len == 64  # inherited from base
    r = load_settings("child", cfg)
    assert r.settings.train.max_steps == 20 and r.source_of("train.max_steps") == f"config {cfg}"
    monkeypatch.setenv("KFORGE_TRAIN__MAX_STEPS", "30")
    r = load_settings("child", cfg)
    assert r.settings.train.max_steps == 30 and r.source_of("train.max_steps") == "env KFORGE_TRAIN__MAX_STEPS"
    r = load_settings("child", cfg, ["--train.max_steps=40"])
    assert r.settings.train.max_steps == 40 and r.source_of("train.max_steps") == "command line --train.max_steps"
    assert r.source_of("train.batch_size") == "default"
    # the last of repeated command-line overrides wins
    assert (
        load_settings("child", cfg, ["--train.max_steps=40", "--train.max_steps", "41"]).settings.train.max_steps == 41
    )


def test_override_values_use_toml_syntax() -> None:
    pairs = dict(
        parse_overrides(
            [
                "--optimizer.betas=[0.8, 0.9]",
                "--train.compile_model=true",
                "--data.path=/tmp/x",
                "--optimizer.lr=1e-4",
                "--scheduler.name",
                "wsd",
                "--slurm.time_limit=01:00:00",
            ]
        )
    )
    assert pairs == {
        "optimizer.betas": [0.8, 0.9],
        "train.compile_model": True,
        "data.path": "/tmp/x",
        "optimizer.lr": 1e-4,
        "scheduler.name": "wsd",
        "slurm.time_limit": "01:00:00",
    }
    s = load_settings(
        overrides=["--optimizer.betas=[0.8, 0.9]", "--data.phases=[{start_step=5, lr_scale=0.5}]"]
    ).settings
    assert s.optimizer.betas == (0.8, 0.9) and s.data.phases[0].lr_scale == 0.5
    with pytest.raises(InvalidInputError, match="--section.key=value"):
        parse_overrides(["positional"])


def test_env_lists_and_nested(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KFORGE_METRICS__BACKENDS", '["jsonl", "mlflow"]')
    monkeypatch.setenv("KFORGE_MODEL__DIM", "192")
    s = load_settings().settings
    assert s.metrics.backends == ["jsonl", "mlflow"] and s.model.dim == 192


def test_unknown_keys_suggest_the_closest_valid_key() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(overrides=["--model.dimm=64", "--train.lr=0.1", "--modle.dim=3"])
    text = str(exc.value)
    assert "model.dimm: unknown key" in text and "did you mean model.dim?" in text
    assert "train.lr: unknown key" in text and "did you mean optimizer.lr?" in text
    assert "modle: unknown key" in text and "did you mean model?" in text
    assert len(exc.value.issues) == 3


def test_two_independent_mistakes_are_both_reported() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(overrides=["--model.dim=100", "--model.n_heads=3", "--train.seq_len=4096"])
    paths = {i.path for i in exc.value.issues}
    assert {"model.dim", "train.seq_len"} <= paths
    assert exc.value.exit_code == 2


def test_field_type_errors_name_the_field_and_source() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(overrides=["--train.batch_size=-1", "--optimizer.name=sgd"])
    text = str(exc.value)
    assert "train.batch_size" in text and "command line --train.batch_size" in text
    assert "optimizer.name" in text and "'sgd'" in text


def test_profile_errors(profile_dir: Path) -> None:
    with pytest.raises(InvalidInputError, match="cycle"):
        load_settings("loop-a")
    with pytest.raises(InvalidInputError, match="unknown profile 'nope'.*cpu-debug"):
        load_settings("nope")
    (profile_dir / "bad.toml").write_text("[train\n")
    with pytest.raises(InvalidInputError, match="not valid TOML"):
        load_settings("bad")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_is_valid_at_its_world_size(name: str) -> None:
    s = load_settings(name).settings
    dims = resolve_dims(s, s.slurm.world_size)
    assert dims.world_size == s.slurm.world_size
    assert name in available_profiles()


def test_h100x64_mesh() -> None:
    s = load_settings("h100x64").settings
    assert s.slurm.world_size == 64
    assert resolve_dims(s, 64).dp_shard == 32


def test_world_size_rules_collect_every_problem() -> None:
    s = load_settings(
        overrides=[
            "--distributed.tp=3",
            "--distributed.pp=8",
            "--distributed.dp_shard=2",
            "--distributed.pp_schedule=interleaved_1f1b",
        ]
    ).settings
    with pytest.raises(ConfigError) as exc:
        resolve_dims(s, 4)
    text = str(exc.value)
    for expected in [
        "world size is 4",
        "does not divide model.n_heads",
        "exceed model.n_layers",
        "needs >= 2 stages per rank",
        "fewer than the 8 pipeline ranks",
    ]:
        assert expected in text, expected
    assert resolve_dims(load_settings(overrides=["--distributed.tp=2"]).settings, 8).dp_shard == 4


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_zero_bubble_schedules_are_refused_on_torch_older_than_2_13(
    monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    from kforge_cli.settings import rules

    pp = ["--distributed.pp=2", "--distributed.pp_stages_per_rank=2", "--train.grad_accum_steps=4"]
    s = load_settings(overrides=[*pp, f"--distributed.pp_schedule={schedule}"]).settings
    monkeypatch.setattr(rules, "torch_version", lambda: (2, 11))
    with pytest.raises(ConfigError) as exc:
        resolve_dims(s, 2)
    assert "distributed.pp_schedule" in str(exc.value) and "needs torch >= 2.13 (this is torch 2.11" in str(exc.value)
    ok = load_settings(overrides=[*pp, "--distributed.pp_schedule=interleaved_1f1b"]).settings
    assert resolve_dims(ok, 2).pp == 2  # the other schedules run on 2.11
    monkeypatch.setattr(rules, "torch_version", lambda: (2, 13))
    assert resolve_dims(s, 2).pp == 2


def test_torch_version_is_read_without_importing_torch() -> None:
    import subprocess
    import sys

    from kforge_cli.settings.torch_version import parse_version

    assert parse_version("2.11.0+cu130") == (2, 11) and parse_version("2.13.0a0+git1") == (2, 13)
    assert parse_version("nightly") is None
    code = (
        "import sys; from kforge_cli.settings.torch_version import torch_version; v = torch_version(); "
        "print(v, 'torch' in sys.modules)"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert got[-1] == "False" and got[0].startswith("(2,")


def test_vlm_rules() -> None:
    with pytest.raises(ConfigError, match="needs a vision encoder"):
        load_settings(overrides=["--vlm.arch=mot"])
    with pytest.raises(ConfigError, match="too short"):
        load_settings("vlm-mot-debug", overrides=["--video.max_frames=8"])
    s = load_settings("vlm-mot-debug").settings
    with pytest.raises(ConfigError, match="not supported for VLM"):
        resolve_dims(s.model_copy(update={"distributed": s.distributed.model_copy(update={"pp": 2})}), 2)


def test_param_count_matches_llama3_8b() -> None:
    assert load_settings("h100x8").settings.model.param_count() == 8_030_261_248


def test_toml_round_trip(tmp_path: Path) -> None:
    s = load_settings("vlm-mot-debug", overrides=["--optimizer.lr=0.001"]).settings
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(s))
    again = load_settings(config=path).settings
    assert again.model_dump() == s.model_dump()


def test_explain_reports_description_default_value_source() -> None:
    r = load_settings("h100x64", overrides=["--optimizer.lr=1e-4"])
    text = explain_key(r, "optimizer.lr")
    assert "Peak learning rate" in text and "default: 0.0003" in text and "value:   0.0001" in text
    assert "command line --optimizer.lr" in text
    assert "profile h100x64" in explain_key(r, "distributed.tp")
    with pytest.raises(InvalidInputError, match="did you mean model.dim"):
        explain_key(r, "model.dimm")


def test_every_field_has_a_description() -> None:
    from kforge_cli.settings.config_layers import _section_class

    missing = []
    for name, info in JobSettings.model_fields.items():
        if not info.description:
            missing.append(name)
        section = _section_class(info.annotation)
        if section is not None:
            missing += [f"{name}.{k}" for k, f in section.model_fields.items() if not f.description]
    assert missing == []


def test_rowwise_float8_on_the_cpu_is_refused_on_torch_older_than_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    from kforge_cli.settings import rules

    overrides = ["--train.device=cpu", "--train.float8=true", "--train.float8_recipe=rowwise"]
    s = load_settings(overrides=overrides, use_env=False).settings
    monkeypatch.setattr(rules, "torch_version", lambda: (2, 11))
    (issue,) = [i for i in rules.world_size_issues(s, 1) if i.path == "train.float8_recipe"]
    assert "needs torch >= 2.13" in issue.message and "torch 2.11" in issue.message
    monkeypatch.setattr(rules, "torch_version", lambda: (2, 13))
    assert not [i for i in rules.world_size_issues(s, 1) if i.path == "train.float8_recipe"]
