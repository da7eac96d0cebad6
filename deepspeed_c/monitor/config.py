"""The monitor sections of the DeepSpeed config: tensorboard, wandb, csv_monitor, comet, trackio.

Keys and defaults are DeepSpeed's. An unknown key inside a section raises, naming the key path
and the closest valid key; a value of the wrong type raises pydantic's ValidationError (a
ValueError) naming the key. The engine's config parser calls `get_monitor_config(param_dict)`.
"""
from __future__ import annotations

import difflib
from typing import Any, ClassVar, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet", "trackio")


class MonitorSectionModel(BaseModel):
    """Base of one monitor section: forbids unknown keys with a helpful message."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True,
                              populate_by_name=True, protected_namespaces=())
    section: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            valid = list(cls.model_fields)
            for key in data:
                if key not in valid:
                    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
                    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
                    raise ValueError(f"unknown key '{cls.section}.{key}'{hint}")
        elif data is not None and not isinstance(data, BaseModel):
            raise ValueError(f"'{cls.section}' must be a JSON object, got {type(data).__name__}: {data!r}")
        return data


class TensorBoardConfig(MonitorSectionModel):
    """TensorBoard event files under output_path/job_name (needs the `tensorboard` package)."""
    section: ClassVar[str] = "tensorboard"

    enabled: bool = False
    output_path: str = ""  # "" means relative to the launch directory
    job_name: str = "DeepSpeedJobName"


class WandbConfig(MonitorSectionModel):
    """Weights & Biases (needs the `wandb` package)."""
    section: ClassVar[str] = "wandb"

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CSVConfig(MonitorSectionModel):
    """One CSV file per metric under output_path/job_name."""
    section: ClassVar[str] = "csv_monitor"

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CometConfig(MonitorSectionModel):
    """Comet (needs `comet_ml` >= 3.41.0). Unset values fall back to Comet's own config and COMET_* env."""
    section: ClassVar[str] = "comet"

    enabled: bool = False
    samples_log_interval: int = 100
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None

    @field_validator("samples_log_interval")
    @classmethod
    def _positive_interval(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"comet.samples_log_interval must be >= 1, got {value}")
        return value

    @field_validator("experiment_key")
    @classmethod
    def _check_key(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not (value.isascii() and value.isalnum() and 32 <= len(value) <= 50):
            raise ValueError(f"comet.experiment_key must be 32 to 50 alphanumeric characters, got {value!r}")
        return value

    @field_validator("mode")
    @classmethod
    def _check_mode(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in ("get", "create", "get_or_create"):
            raise ValueError(f"comet.mode must be 'get', 'create' or 'get_or_create', got {value!r}")
        return value


class TrackioConfig(MonitorSectionModel):
    """Trackio (needs the `trackio` package)."""
    section: ClassVar[str] = "trackio"

    enabled: bool = False
    project: str = "deepspeed"


class DeepSpeedMonitorConfig(MonitorSectionModel):
    """All monitor sections; `enabled` is true when any of them is."""
    section: ClassVar[str] = "monitor"

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    trackio: TrackioConfig = Field(default_factory=TrackioConfig)

    @property
    def enabled(self) -> bool:
        return (self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled or self.comet.enabled
                or self.trackio.enabled)


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a whole DeepSpeed config dict (missing sections take defaults)."""
    sections = {}
    for key in MONITOR_SECTIONS:
        value = param_dict.get(key, {})
        sections[key] = {} if value is None else value
    return DeepSpeedMonitorConfig(**sections)
