"""`JobSettings`: the ONE settings model every subcommand and the engine share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pydantic import field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kforge_cli.settings.data import DataSettings, EvalSettings
from kforge_cli.settings.infrastructure import (
    CheckpointSettings,
    DistributedSettings,
    MetricsSettings,
    PlanSettings,
    ProfilingSettings,
    ResilienceSettings,
    SlurmSettings,
)
from kforge_cli.settings.section import field, reject_control_characters
from kforge_cli.settings.training import ModelSettings, OptimizerSettings, SchedulerSettings, TrainSettings
from kforge_cli.settings.vlm import AdapterSettings, VideoSettings, VisionEncoderSettings, VLMSettings

_READ_ENV: ContextVar[bool] = ContextVar("kforge_read_env", default=True)


@contextmanager
def without_environment() -> Iterator[None]:
    """Build :class:`JobSettings` inside from the given values only (``load_settings(use_env=False)``)."""
    token = _READ_ENV.set(False)
    try:
        yield
    finally:
        _READ_ENV.reset(token)


class JobSettings(BaseSettings):
    """Everything a kforge job needs, validated.

    Built by :func:`kforge_cli.settings.load_settings` from, lowest to highest
    precedence: defaults, a profile, a TOML config file, ``KFORGE_SECTION__KEY``
    environment variables and ``--section.key=value`` command-line overrides.
    Constructing it directly in Python reads the environment too (keyword arguments win).
    """

    model_config = SettingsConfigDict(  # type: ignore[assignment]
        env_prefix="KFORGE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        case_sensitive=False,
        allow_inf_nan=False,
    )

    profile: str | None = field(None, "Name of the profile this configuration was built from.")
    model: ModelSettings = field(ModelSettings, "Transformer architecture.")
    train: TrainSettings = field(TrainSettings, "Training loop.")
    optimizer: OptimizerSettings = field(OptimizerSettings, "Optimizer.")
    scheduler: SchedulerSettings = field(SchedulerSettings, "Learning-rate schedule.")
    data: DataSettings = field(DataSettings, "Training data.")
    eval: EvalSettings = field(EvalSettings, "Evaluation.")
    distributed: DistributedSettings = field(DistributedSettings, "Parallelism.")
    checkpoint: CheckpointSettings = field(CheckpointSettings, "Checkpointing and resume.")
    metrics: MetricsSettings = field(MetricsSettings, "Metrics and experiment tracking.")
    profiling: ProfilingSettings = field(ProfilingSettings, "torch.profiler window.")
    resilience: ResilienceSettings = field(ResilienceSettings, "NaN policy and signals.")
    slurm: SlurmSettings = field(SlurmSettings, "Cluster shape and SLURM options.")
    plan: PlanSettings = field(PlanSettings, "Step-time cost model of kforge plan (show, search, trial, calibrate).")
    vision_encoder: VisionEncoderSettings | None = field(None, "Vision encoder (VLM jobs only).")
    adapter: AdapterSettings | None = field(None, "Vision-to-text adapter (VLM jobs only).")
    vlm: VLMSettings | None = field(None, "Vision-language architecture (VLM jobs only).")
    video: VideoSettings | None = field(None, "Video clips (video VLM jobs only).")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if not _READ_ENV.get():  # load_settings(use_env=False): the values given, nothing from the environment
            return (init_settings,)
        return (init_settings, env_settings, dotenv_settings, file_secret_settings)

    @field_validator("profile", mode="after")
    @classmethod
    def _printable(cls, value: object) -> object:
        return reject_control_characters(value)

    @property
    def data_seed(self) -> int:
        """The seed of the data order (train.data_seed, defaulting to train.seed)."""
        return self.train.seed if self.train.data_seed is None else self.train.data_seed
