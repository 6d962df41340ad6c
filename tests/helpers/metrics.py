"""Reading a run's metrics.jsonl in tests."""

from __future__ import annotations

from pathlib import Path

from kforge_cli.engine.observe import read_metrics


def step_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step (a step logged twice after an interruption: the later record wins)."""
    return {rec["step"]: rec["loss"] for rec in read_metrics(run_dir / "metrics.jsonl") if "loss" in rec}
