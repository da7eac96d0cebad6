"""DeepSpeed's `deepspeed.runtime.precision_config`: the `fp16` / `bf16` section models and the
helpers that read them from a whole config dict. The models live in runtime/config/precision.py;
this module is the public path DeepSpeed scripts import them from."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.config.precision import (CONSECUTIVE_HYSTERESIS, DELAYED_SHIFT, INITIAL_LOSS_SCALE,
                                                  MIN_LOSS_SCALE, SCALE_WINDOW, DeepSpeedBF16Config,
                                                  DeepSpeedFP16Config)
from deepspeed_c.runtime.config.utils import parse_section

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # the section's earlier name, still read
FP16 = "fp16"

__all__ = ["BFLOAT16", "BFLOAT16_OLD", "FP16", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config",
           "get_float16_config", "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS",
           "MIN_LOSS_SCALE"]


def get_bfloat16_config(param_dict: dict[str, Any]) -> DeepSpeedBF16Config:
    """The `bf16` section of a config dict (`bfloat16` when `bf16` is absent), defaults filled in."""
    key = BFLOAT16 if param_dict.get(BFLOAT16) is not None else BFLOAT16_OLD
    return parse_section(DeepSpeedBF16Config, param_dict.get(key), key)


def get_float16_config(param_dict: dict[str, Any]) -> DeepSpeedFP16Config:
    """The `fp16` section of a config dict, defaults filled in."""
    return parse_section(DeepSpeedFP16Config, param_dict.get(FP16), FP16)
