"""A layout the search found, as profile text (`kforge plan search --write-profile`, each trial's profile)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kforge_cli.engine.plan.search import Candidate
    from kforge_cli.settings import JobSettings


def candidate_profile(settings: JobSettings, candidate: Candidate) -> str:
    """The profile text of ``candidate`` (its layout and cluster shape over ``settings``): it extends the
    profile ``settings`` came from, and its description carries the cost model's step and its parts."""
    from kforge_cli.engine.plan.cost_model import step_parts
    from kforge_cli.settings import load_settings
    from kforge_cli.settings.profile_writer import extends_name, profile_toml
    from kforge_cli.settings.profiles import DEFAULT_PROFILE

    base = load_settings(profile=settings.profile or DEFAULT_PROFILE, use_env=False).settings
    e = candidate.estimate
    n = candidate.dims.world_size
    gpu = settings.slurm.gpu_type
    description = (
        f"{candidate.layout.describe()} on {n} x {gpu}: predicted {e.step_s:.4g} s/step, "
        f"peak {candidate.peak_bytes / 2**30:.1f} GiB per GPU (kforge plan search)"
    )
    comment = [
        f"Written by `kforge plan search --write-profile` over {extends_name(settings)}.",
        f"Predicted {e.step_s:.4g} s/step {step_parts(e)}.",
        "Check it: kforge plan --profile THIS_FILE",
    ]
    return profile_toml(candidate.settings, base, description, comment)
