"""The `autotuning` config section, typed, with DeepSpeed's keys and defaults."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import field_validator

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, DeepSpeedConfigModel, parse_section

METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based")


class AutotuningConfig(DeepSpeedConfigModel):
    enabled: bool = False
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: int = 3
    end_profile_step: int = 5
    metric_path: Optional[str] = None
    metric: str = "throughput"
    tuner_type: str = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: Optional[dict[str, str]] = None
    max_train_batch_size: Optional[int] = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    mp_size: int = 1
    model_info_path: Optional[str] = None
    model_info: Optional[dict[str, Any]] = None

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"autotuning.metric must be one of {', '.join(METRICS)}, got {v!r}")
        return v

    @field_validator("tuner_type")
    @classmethod
    def _tuner(cls, v: str) -> str:
        if v not in TUNERS:
            raise ValueError(f"autotuning.tuner_type must be one of {', '.join(TUNERS)}, got {v!r}")
        return v


def parse_autotuning(raw: Any) -> AutotuningConfig:
    cfg = parse_section(AutotuningConfig, raw, "autotuning")
    if cfg.end_profile_step < cfg.start_profile_step:
        raise DeepSpeedConfigError(f"autotuning.end_profile_step ({cfg.end_profile_step}) must be >= "
                                   f"autotuning.start_profile_step ({cfg.start_profile_step})")
    return cfg
