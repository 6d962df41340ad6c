"""`kforge validate-config --plan` in a subprocess: the table, the JSON, and exit 1 when it does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

GIB = 1024**3


def test_plan_table_for_70b_on_h100x64(kforge, data_stub: Path) -> None:
    r = kforge("validate-config", "--profile", "llama70b-h100x64", "--plan", "--rank", "9", f"--data.path={data_stub}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "config is valid: profile llama70b-h100x64, world size 64" in out
    assert "mesh: pp=1 x dp_replicate=1 x dp_shard=8 x tp=8; rank 9 sits at pp=0 dp_replicate=0 dp_shard=1 tp=1" in out
    assert "80 blocks (0-79) + embedding, norm + head" in out
    for item in ("parameters", "gradients", "optimizer state", "activations", "FSDP buffers", "peak"):
        assert f"\n  {item} " in out, item
    assert "FITS (biggest item: optimizer state" in out
    assert "at 40% MFU of 989.4 TFLOP/s per GPU" in out


def test_plan_json_for_8b_fsdp64(kforge, data_stub: Path) -> None:
    r = kforge(
        "validate-config",
        "--profile",
        "h100x64",
        "--distributed.tp=1",
        "--plan",
        "--format",
        "json",
        "--mfu",
        "0.5",
        f"--data.path={data_stub}",
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)  # nothing but the plan on stdout
    assert plan["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "tp": 1}
    assert plan["local_params"] * 64 == plan["total_params"] == 8_030_261_248
    params = next(m for m in plan["memory"] if m["name"] == "parameters")
    assert params["bytes"] == 4 * plan["total_params"] // 64
    assert plan["throughput"]["mfu"] == 0.5
    assert plan["verdict"] in ("FITS", "DOES NOT FIT") and plan["fits"] == (plan["verdict"] == "FITS")


def test_plan_for_moe_with_expert_and_tensor_parallelism(kforge, data_stub: Path) -> None:
    """An MoE profile with tp = 2 x ep = 4 on 8 GPUs: valid, and the plan says how its experts are split."""
    r = kforge(
        "validate-config",
        "--profile",
        "moe16b-h100x8",
        "--distributed.tp=2",
        "--distributed.ep=4",
        "--plan",
        "--format",
        "json",
        f"--data.path={data_stub}",
    )
    assert r.returncode in (0, 1), r.stderr  # 1: valid, but does not fit
    plan = json.loads(r.stdout)
    assert plan["mesh"]["tp"] == 2 and plan["mesh"]["dp_shard"] == 4 and plan["mesh"]["ep"] == 4
    notes = " ".join(plan["notes"])
    assert "16 of 64 experts each (ep = 4)" in notes
    assert "MoE x TP: shared experts split over them, router and routed experts whole on each of the tp = 2" in notes


def test_plan_that_does_not_fit_exits_1(kforge, data_stub: Path) -> None:
    data = f"--data.path={data_stub}"
    r = kforge(
        "validate-config",
        "--profile",
        "llama70b-h100x64",
        "--slurm.nodes=1",
        "--distributed.dp_shard=1",
        "--plan",
        "--format",
        "json",
        data,
    )
    assert r.returncode == 1, r.stderr
    plan = json.loads(r.stdout)
    assert plan["verdict"] == "DOES NOT FIT" and plan["biggest"] == "optimizer state"
    assert plan["peak_bytes"] > plan["capacity_bytes"] == 80 * GIB
    table = kforge(
        "validate-config",
        "--profile",
        "llama70b-h100x64",
        "--slurm.nodes=1",
        "--distributed.dp_shard=1",
        "--plan",
        data,
    )
    assert table.returncode == 1
    assert "DOES NOT FIT (biggest item: optimizer state" in table.stdout


def test_plan_bad_rank_and_format_are_input_errors(kforge) -> None:
    r = kforge("validate-config", "--plan", "--world-size", "2", "--rank", "2")
    assert r.returncode == 2 and "--rank must be in [0, 1]" in r.stderr
    r = kforge("validate-config", "--plan", "--format", "toml")
    assert r.returncode == 2 and "--plan prints a table" in r.stderr


def test_search_prints_valid_layouts_and_writes_a_profile_that_validates(
    kforge, data_stub: Path, tmp_path: Path
) -> None:
    best = tmp_path / "best.toml"
    data = f"--data.path={data_stub}"
    r = kforge(
        "validate-config",
        "-p",
        "llama70b-h100x64",
        "--plan",
        "--search",
        "--format",
        "json",
        data,
        "--write-profile",
        str(best),
    )
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["world_size"] == 64 and len(found["top"]) == 5
    steps = [t["predicted"]["step_s"] for t in found["top"]]
    assert steps == sorted(steps) and all(t["peak_bytes"] <= found["memory_limit_bytes"] for t in found["top"])
    first = found["top"][0]
    check = kforge("validate-config", "-p", "llama70b-h100x64", data, *first["overrides"], "--plan", "--format", "json")
    assert check.returncode == 0, check.stderr  # the layout as printed passes validate-config at world size 64
    assert json.loads(check.stdout)["mesh"]["tp"] == first["layout"]["tp"]
    again = kforge("validate-config", "--profile", str(best), "--plan", "--format", "json")  # nothing else given
    assert again.returncode == 0, again.stderr
    plan = json.loads(again.stdout)
    assert plan["world_size"] == 64 and plan["mesh"]["pp"] == first["layout"]["pp"]
    refused = kforge(
        "validate-config", "-p", "llama70b-h100x64", "--plan", "--search", data, "--write-profile", str(best)
    )
    assert refused.returncode == 2 and "exists; choose another file or pass --overwrite" in refused.stderr


def test_search_options_need_plan_search(kforge) -> None:
    r = kforge("validate-config", "--write-profile", "x.toml")
    assert r.returncode == 2 and "go with --plan --search" in r.stderr
