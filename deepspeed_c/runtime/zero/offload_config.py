"""DeepSpeed's `deepspeed.runtime.zero.offload_config` names: the offload config sections and the
enums users pass to `engine.offload_states()`."""
from deepspeed_c.runtime.config.zero import (DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
                                             OffloadDeviceEnum)
from deepspeed_c.runtime.zero.state_offload import OffloadStateTypeEnum

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
