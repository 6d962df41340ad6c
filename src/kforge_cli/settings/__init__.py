"""The ONE settings model (`JobSettings`) and how it is loaded and validated. No torch here."""

from kforge_cli.settings.config_layers import ResolvedSettings, load_settings, parse_overrides
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.parallel_dims import ParallelDims
from kforge_cli.settings.rules import config_issues, resolve_dims, world_size_issues

__all__ = [
    "JobSettings",
    "ParallelDims",
    "ResolvedSettings",
    "config_issues",
    "load_settings",
    "parse_overrides",
    "resolve_dims",
    "world_size_issues",
]
