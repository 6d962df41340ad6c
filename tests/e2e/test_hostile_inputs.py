"""Hostile and careless inputs through the real `kforge` command: exit 2, a message, no traceback."""

from __future__ import annotations

import pytest

from tests.conftest import run_kforge

pytestmark = pytest.mark.e2e

# A sample of tests/unit/test_settings_generated.py's cases, through the console script.
SAMPLE = [
    ("--optimizer.lr=inf", "optimizer.lr"),
    ("--optimizer.betas=[2.0,0.9]", "optimizer.betas.0"),
    ("--model.ffn_dim_multiplier=inf", "model.ffn_dim_multiplier"),
    ("--slurm.gpu_memory_gb=nan", "slurm.gpu_memory_gb"),
    ("--train.run_dir=/x/sb\ntouch /x/PWNED #", "train.run_dir"),
]


@pytest.mark.parametrize(("arg", "key"), SAMPLE, ids=[k for _, k in SAMPLE])
def test_bad_settings_values_through_validate_config(arg: str, key: str) -> None:
    r = run_kforge("validate-config", arg, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"{key}:" in r.stderr and "Traceback" not in r.stderr, r.stderr
