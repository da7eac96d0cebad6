"""The typed `comms_logger` config section (DeepSpeed's CommsLoggerConfig and DeepSpeedCommsConfig).

The engine's config parser imports CommsLoggerConfig to validate the section; nothing else reads
the raw dict."""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepspeed_c.comm.constants import (COMMS_LOGGER, COMMS_LOGGER_DEBUG_DEFAULT, COMMS_LOGGER_ENABLED_DEFAULT,
                                        COMMS_LOGGER_PROF_ALL_DEFAULT, COMMS_LOGGER_VERBOSE_DEFAULT)


class CommsLoggerConfig(BaseModel):
    """`"comms_logger": {"enabled", "verbose", "prof_all", "prof_ops", "debug"}` with DeepSpeed's defaults."""

    # unknown keys raise, as in DeepSpeed's validated sections
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    enabled: bool = COMMS_LOGGER_ENABLED_DEFAULT
    prof_all: bool = COMMS_LOGGER_PROF_ALL_DEFAULT
    prof_ops: list[str] = Field(default_factory=list)
    verbose: bool = COMMS_LOGGER_VERBOSE_DEFAULT
    debug: bool = COMMS_LOGGER_DEBUG_DEFAULT

    @field_validator("prof_ops", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        # a single op name is a common shorthand for a one-element list
        return [value] if isinstance(value, str) else value


class DeepSpeedCommsConfig:
    """The comms part of a whole DeepSpeed config dict, as DeepSpeed's engine config holds it
    (`config.comms_config`)."""

    def __init__(self, ds_config: Mapping[str, Any]) -> None:
        section = ds_config.get(COMMS_LOGGER) if isinstance(ds_config, Mapping) else None
        self.comms_logger_enabled = section is not None
        self.comms_logger = CommsLoggerConfig(**section) if section is not None else CommsLoggerConfig()
