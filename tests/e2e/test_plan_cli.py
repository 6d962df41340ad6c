"""`kforge plan` (and its alias `validate-config --plan`) in a subprocess: the table, the JSON, exit 1 when
it does not fit; `kforge plan search`: one step time per layout, whichever command prints it."""

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
    assert "at 40% MFU of 989.4 TFLOP/s per GPU: 16.46 s/step" in out
    assert "= compute 13.245 s (recompute 3.279) + exposed comm fsdp 0.695, tp 2.505 + bubble 0.000" in out
    alias = out[out.index("parallel plan:") :]
    direct = kforge("plan", "--profile", "llama70b-h100x64", "--rank", "9")
    assert direct.returncode == 0, direct.stderr
    strip = [line for line in alias.splitlines() if "built in" not in line]
    assert strip == [line for line in direct.stdout.splitlines() if "built in" not in line]  # the alias prints it


def test_plan_json_for_8b_fsdp64(kforge) -> None:
    r = kforge("plan", "--profile", "h100x64", "--format", "json", "--mfu", "0.5", "--distributed.tp=1")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)  # nothing but the plan on stdout
    assert plan["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "tp": 1}
    assert plan["local_params"] * 64 == plan["total_params"] == 8_030_261_248
    params = next(m for m in plan["memory"] if m["name"] == "parameters")
    assert params["bytes"] == 4 * plan["total_params"] // 64
    assert plan["throughput"]["mfu"] == 0.5 == plan["constants"]["mfu"]
    assert plan["throughput"]["step_time_s"] == plan["step"]["step_s"] > plan["step"]["compute_s"] > 0
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
    r = kforge("plan", "search", "-p", "llama70b-h100x64", "--format", "json", "--write-profile", str(best))
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["world_size"] == 64 and len(found["top"]) == 5
    steps = [t["predicted"]["step_s"] for t in found["top"]]
    assert steps == sorted(steps) and all(t["peak_bytes"] <= found["memory_limit_bytes"] for t in found["top"])
    first = found["top"][0]
    check = kforge("validate-config", "-p", "llama70b-h100x64", data, *first["overrides"], "--plan", "--format", "json")
    assert check.returncode == 0, check.stderr  # the layout as printed passes validate-config at world size 64
    assert json.loads(check.stdout)["mesh"]["tp"] == first["layout"]["tp"]
    again = kforge("validate-config", "--profile", str(best), "--plan", "--format", "json", data)  # nothing else
    assert again.returncode == 0, again.stderr
    plan = json.loads(again.stdout)
    assert plan["world_size"] == 64 and plan["mesh"]["pp"] == first["layout"]["pp"]
    assert plan["step"]["step_s"] == pytest.approx(first["predicted"]["step_s"], rel=1e-9)
    refused = kforge("plan", "search", "-p", "llama70b-h100x64", "--write-profile", str(best))
    assert refused.returncode == 2 and "exists; choose another file or pass --overwrite" in refused.stderr


@pytest.mark.parametrize("profile", ["h100x64", "llama70b-h100x64", "moe16b-h100x64"])
def test_one_step_time_per_layout_whichever_command_prints_it(kforge, tmp_path: Path, profile: str) -> None:
    """The search's winner gets the same step from `kforge plan --profile WRITTEN` (within 1%: exactly here);
    the shipped layout, listed by the search, gets the number `kforge plan --profile SHIPPED` prints, and
    the winner's is no larger."""
    written = tmp_path / "best.toml"
    r = kforge("plan", "search", "-p", profile, "--format", "json", "--write-profile", str(written))
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    winner = found["top"][0]["predicted"]
    best = kforge("plan", "--profile", str(written), "--format", "json")
    assert best.returncode == 0, best.stderr
    assert json.loads(best.stdout)["step"]["step_s"] == pytest.approx(winner["step_s"], rel=0.01)
    assert json.loads(best.stdout)["step"] == winner  # and its parts, to the last digit
    shipped = kforge("plan", "--profile", profile, "--format", "json")
    assert shipped.returncode == 0, shipped.stderr
    own = json.loads(shipped.stdout)["step"]
    assert found["given"] is not None, found["given_note"]  # the shipped layout is in the space and fits
    assert found["given"]["predicted"]["step_s"] == own["step_s"]
    assert winner["step_s"] <= own["step_s"]
    table = kforge("plan", "search", "-p", profile)
    assert f"{own['step_s']:>7.4g} s" in table.stdout.split("the profile's own layout")[1]


def test_plan_imports_no_data_observe_checkpoint_or_trackers(kforge) -> None:
    """`kforge plan` builds the model on meta and plans it without the data, observe or checkpoint
    packages, Hugging Face, the trackers or matplotlib."""
    code = (
        "import sys\n"
        "from kforge_cli.cli.app import main\n"
        "try:\n"
        "    main(['plan', '-p', 'moe16b-h100x64'])\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "bad = ('kforge_cli.engine.data', 'kforge_cli.engine.observe', 'kforge_cli.engine.checkpoint',\n"
        "       'transformers', 'wandb', 'mlflow', 'matplotlib')\n"
        "found = sorted(m for m in sys.modules if m.split('.')[0] in bad or m.startswith(bad))\n"
        "assert 'kforge_cli.engine.plan.planner' in sys.modules\n"
        "print('IMPORTED', found)\n"
    )
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "IMPORTED []" in r.stdout, r.stdout[-2000:]


def test_validate_config_plan_flags_moved_to_kforge_plan(kforge) -> None:
    for args, now in (
        (["--plan", "--search"], "kforge plan search"),
        (["--write-profile", "x.toml"], "kforge plan search --write-profile FILE"),
        (["--plan", "--top", "3"], "kforge plan search --top N"),
        (["--trial", "3"], "kforge plan trial --best K"),
        (["--sbatch"], "kforge plan trial --sbatch"),
        (["--plan", "--mfu=0.5"], "kforge plan --mfu X"),
    ):
        r = kforge("validate-config", *args)
        assert r.returncode == 2 and f"use `{now}`" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
