"""Typed precision sections: `fp16`, `bf16` (alias `bfloat16`), `torch_autocast`, `amp` and
`data_types`, with DeepSpeed 0.19's keys and defaults."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from deepspeed_c.runtime.config.utils import (DeepSpeedConfigError, DeepSpeedConfigModel, parse_dtype,
                                              parse_section, unbuilt)

# the names of DeepSpeed's dynamic loss scaler arguments (deepspeed.runtime.fp16.loss_scaler)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0  # 0 selects dynamic loss scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale(cls, v: Any) -> float:
        # DeepSpeed takes anything float() takes ("3" too), but not a bool
        if isinstance(v, bool):
            raise ValueError("must be a number >= 0 (0 enables dynamic loss scaling), not a bool")
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ValueError("must be a number >= 0 (0 enables dynamic loss scaling)") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError("must be a finite number >= 0 (0 enables dynamic loss scaling)")
        return v

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _scaler_integer(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic would turn True into 1 and pass inf on to a confusing message
        if isinstance(v, bool):
            raise ValueError(f"fp16.{info.field_name} must be an integer, not a bool")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"fp16.{info.field_name} must be a finite integer, got {v}")
        return v

    @model_validator(mode="after")
    def _dynamic_scaler_ranges(self) -> "DeepSpeedFP16Config":
        # the dynamic scaler's knobs are checked only where the dynamic scaler runs (as DeepSpeed): a
        # disabled section or a static scale may carry any leftover values
        if not (self.enabled and self.loss_scale == 0):
            return self
        if self.loss_scale_window <= 0:
            raise ValueError("fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled "
                             f"(loss_scale=0), got {self.loss_scale_window}")
        if self.min_loss_scale <= 0:
            raise ValueError("fp16.min_loss_scale must be > 0 when dynamic loss scaling is enabled "
                             f"(loss_scale=0), got {self.min_loss_scale}")
        if not 0 <= self.initial_scale_power <= 127:
            raise ValueError(f"fp16.initial_scale_power must be in [0, 127], got {self.initial_scale_power}")
        if self.hysteresis < 1:
            raise ValueError(f"fp16.hysteresis must be >= 1, got {self.hysteresis}")
        return self

    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        return {
            INITIAL_LOSS_SCALE: self.initial_dynamic_scale(),
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = Field(True, alias="check_overflow")  # DeepSpeed 0.19.8: on by default, as fp16
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


DEFAULT_LOWER_PRECISION_SAFE_MODULES = [
    "torch.nn.modules.linear.Linear",
    "torch.nn.modules.conv.Conv1d",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.conv.Conv3d",
]


class TorchAutocastConfig(DeepSpeedConfigModel):
    enabled: bool = False
    dtype: Optional[Any] = None
    lower_precision_safe_modules: Optional[list[str]] = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Optional[torch.dtype]:
        try:
            return parse_dtype(v, "torch_autocast.dtype", [torch.float16, torch.bfloat16, torch.float32])
        except DeepSpeedConfigError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None


class DataTypesConfig(DeepSpeedConfigModel):
    grad_accum_dtype: Optional[str] = None
    param_dtype: Optional[str] = None
    buffer_dtype: Optional[str] = None


def parse_precision(param_dict: dict[str, Any], zero_stage: int = 0) -> dict[str, Any]:
    """The precision sections of a whole config, validated and cross-checked."""
    fp16 = parse_section(DeepSpeedFP16Config, param_dict.get("fp16"), "fp16")
    if "bf16" in param_dict and "bfloat16" in param_dict:
        raise DeepSpeedConfigError("Config keys 'bf16' and 'bfloat16' are the same section; give only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in param_dict else "bf16"
    bf16 = parse_section(DeepSpeedBF16Config, param_dict.get(bf16_key), bf16_key)
    if fp16.enabled and bf16.enabled:
        raise DeepSpeedConfigError(
            f"Config keys 'fp16.enabled' and '{bf16_key}.enabled' are both true: bfloat16 and fp16 modes "
            f"cannot be simultaneously enabled; enable at most one")
    autocast = parse_section(TorchAutocastConfig, param_dict.get("torch_autocast"), "torch_autocast")
    if autocast.enabled and (fp16.enabled or bf16.enabled):
        raise DeepSpeedConfigError(
            "Config key 'torch_autocast.enabled' cannot be combined with 'fp16.enabled' or 'bf16.enabled': "
            "torch autocast keeps fp32 parameters; choose one precision mode")
    if autocast.enabled and autocast.dtype is None:
        autocast.dtype = torch.bfloat16
    data_types = parse_section(DataTypesConfig, param_dict.get("data_types"), "data_types")
    model_dtype = torch.float16 if fp16.enabled else torch.bfloat16 if bf16.enabled else torch.float32
    grad_accum = parse_dtype(data_types.grad_accum_dtype, "data_types.grad_accum_dtype")
    param_dtype = parse_dtype(data_types.param_dtype, "data_types.param_dtype")
    buffer_dtype = parse_dtype(data_types.buffer_dtype, "data_types.buffer_dtype")
    if param_dtype is not None and param_dtype != model_dtype:
        raise DeepSpeedConfigError(
            f"Invalid value {data_types.param_dtype!r} for config key 'data_types.param_dtype': it must match "
            f"the enabled precision mode (model dtype {model_dtype})")

    amp = param_dict.get("amp")
    if amp is not None:
        if not isinstance(amp, dict):
            raise DeepSpeedConfigError(f"Config key 'amp' must be a JSON object (dict), got {amp!r}")
        if amp.get("enabled", False) is True:
            raise unbuilt("amp.enabled", "NVIDIA Apex AMP (use fp16/bf16 or torch_autocast instead)")
    if fp16.fp16_master_weights_and_grads and zero_stage not in (1, 2, 3):
        raise DeepSpeedConfigError(
            "Config key 'fp16.fp16_master_weights_and_grads' is only supported with ZeRO stage 1, 2 or 3")
    if bf16.bf16_master_weights_and_grads and zero_stage not in (1, 2, 3):
        raise DeepSpeedConfigError(
            f"Config key '{bf16_key}.bf16_master_weights_and_grads' is only supported with ZeRO stage 1, 2 or 3")
    if bf16.bf16_optimizer_states and (zero_stage not in (1, 2, 3) or not bf16.bf16_master_weights_and_grads):
        raise DeepSpeedConfigError(
            f"Config key '{bf16_key}.bf16_optimizer_states' is only supported with ZeRO stage 1, 2 or 3 and "
            f"'{bf16_key}.bf16_master_weights_and_grads'")
    # DeepSpeed 0.19's optimizer selection: under ZeRO every (model, grad_accum) pair is accepted; without
    # ZeRO the accumulation dtype must be the model dtype, except bf16 parameters with fp32 accumulation
    # (its BF16_Optimizer)
    if (grad_accum is not None and zero_stage == 0 and grad_accum != model_dtype
            and not (model_dtype == torch.bfloat16 and grad_accum == torch.float32)):
        raise unbuilt("data_types.grad_accum_dtype",
                      f"gradient accumulation in {grad_accum} with {model_dtype} parameters without ZeRO "
                      f"(DeepSpeed refuses this mix too; only bf16 parameters may accumulate in fp32)")
    return {
        "float16_config": fp16, "bfloat16_config": bf16, "torch_autocast_config": autocast,
        "data_types_config": data_types, "grad_accum_dtype": grad_accum, "param_dtype": param_dtype,
        "buffer_dtype": buffer_dtype, "amp_enabled": False, "amp_params": dict(amp or {}),
    }


def check_grad_accum_mix(config: Any, pipeline: bool) -> None:
    """DeepSpeed's optimizer sanity check at initialize: without ZeRO the gradient accumulation dtype is
    the model's (its BF16_Optimizer serves bf16 with fp32 accumulation at stage 1 only). The other mixes
    are refused when the config is read (parse_precision); bf16 with fp32 is refused here, once an
    optimizer is built, as DeepSpeed does. A pipeline keeps it: DeepSpeed's PipelineEngine accumulates
    bf16 gradients in fp32 (BF16_Optimizer) by default, which deepspeed_c's does under this key."""
    if config.zero_optimization_stage != 0 or pipeline:
        return
    fp16, bf16 = config.float16_config.enabled, config.bfloat16_config.enabled
    model_dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    accum = parse_dtype(config.grad_accum_dtype, "data_types.grad_accum_dtype") or model_dtype
    if accum != model_dtype:
        mode = "fp16.enabled" if fp16 else "bf16.enabled" if bf16 else "no fp16/bf16 section"
        raise NotImplementedError(
            f"unsupported mix of model_dtype={model_dtype} and grad_accum_dtype={accum}: config key "
            f"'data_types.grad_accum_dtype' ({config.grad_accum_dtype!r}) must match the model dtype ({mode}) "
            f"at 'zero_optimization.stage' 0; fp32 accumulation of a bf16 model needs stage 1 (DeepSpeed's "
            f"BF16_Optimizer)")
