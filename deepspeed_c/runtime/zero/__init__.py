"""deepspeed_c.zero (alias of deepspeed_c.runtime.zero): ZeRO's public names.

Stages 1 and 2 (with CPU optimizer offload) run in stage_1_and_2.py; stage 3 in stage3.py with
partition_parameters.py (zero.Init, GatheredParameters, the partitioned parameter contract)."""
from __future__ import annotations

from deepspeed_c.runtime.config.zero import ZeroStageEnum  # noqa: F401  (DeepSpeed exposes it here)
from deepspeed_c.runtime.zero.partition_parameters import (GatheredParameters, Init, ZeroParamStatus,  # noqa: F401
                                                           register_external_parameter,
                                                           unregister_external_parameter)
from deepspeed_c.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias  # noqa: F401

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "TiledLinear", "TiledLinearReturnBias", "MiCS_Init", "unwrap_model_for_generation"]

from deepspeed_c._lazy import lazy_exports as _lazy_exports

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {
    "MiCS_Init": "deepspeed_c.runtime.zero.mics:MiCS_Init",
    "unwrap_model_for_generation": "deepspeed_c.runtime.zero.unwrap:unwrap_model_for_generation"})
