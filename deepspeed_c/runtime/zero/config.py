"""DeepSpeed's public path for the ZeRO config types (`deepspeed.runtime.zero.config`); they live in
runtime/config/zero.py. DeepSpeed pickles `ZeroStageEnum` into ZeRO checkpoints under this path."""
from deepspeed_c.runtime.config.zero import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                             DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum, ZeroStageEnum,
                                             get_zero_config)

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum", "get_zero_config"]
