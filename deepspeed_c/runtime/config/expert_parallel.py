"""The `expert_parallel` section (AutoEP): DeepSpeed's keys and defaults, checked once here.

Routing fields default to "auto" (taken from the Hugging Face model, whose router stays in place); a
routing or kernel choice deepspeed_c does not build raises NotImplementedError naming its key. The section
cannot combine with AutoTP (tensor_parallel.autotp_size > 1) or ZeRO stage 3."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import Field

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, DeepSpeedConfigModel, parse_section, unbuilt


class ExpertParallelConfig(DeepSpeedConfigModel):
    enabled: bool = False
    autoep_size: int = Field(1, ge=1)
    preset_model: Optional[str] = None
    moe_layer_pattern: Optional[str] = None
    expert_pattern: Optional[str] = None
    router_pattern: Optional[str] = None
    expert_w1: Optional[str] = None
    expert_w2: Optional[str] = None
    expert_w3: Optional[str] = None
    use_grouped_mm: bool = True
    route_scale: float = 1.0
    # routing: "auto" takes the model's own (deepspeed_c keeps the Hugging Face router)
    route_norm: Optional[Union[bool, str]] = None
    score_func: str = "auto"
    score_apply: str = "auto"
    top_k: Union[int, str] = "auto"
    routed_scaling_factor: Union[float, str] = "auto"
    num_experts_attr: Optional[str] = None
    top_k_attr: Optional[str] = None
    load_balance_coeff: Optional[float] = None
    expert_tensor_parallel_size: int = Field(1, ge=1)
    comm_backend: str = "comm"


# keys whose non-default value asks for something deepspeed_c does not build: (default, what)
_UNBUILT_VALUES: dict[str, tuple[Any, str]] = {
    "expert_w3": (None, "separate gate and up expert weights (only the fused gate_up layout of transformers 5)"),
    "route_norm": (None, "a routing override (the Hugging Face router is kept)"),
    "score_func": ("auto", "a routing override (the Hugging Face router is kept)"),
    "score_apply": ("auto", "a routing override (weights apply after the expert, as Hugging Face's)"),
    "top_k": ("auto", "a routing override (the Hugging Face router is kept)"),
    "routed_scaling_factor": ("auto", "a routing override (the Hugging Face router is kept)"),
    "expert_tensor_parallel_size": (1, "expert tensor parallelism"),
    "comm_backend": ("comm", "a non-default all-to-all backend (DeepEP)"),
}


def parse_expert_parallel(param_dict: dict[str, Any], zero_stage: int, autotp_size: int) -> ExpertParallelConfig:
    raw = param_dict.get("expert_parallel")
    if isinstance(raw, dict):  # "auto" is this section's own default for routing fields, not Hugging Face's gap
        raw = {k: v for k, v in raw.items() if v != "auto"}
    cfg = parse_section(ExpertParallelConfig, raw, "expert_parallel")
    if cfg.load_balance_coeff is not None:
        raise DeepSpeedConfigError(f"Invalid value {cfg.load_balance_coeff!r} for config key "
                                   "'expert_parallel.load_balance_coeff': DeepSpeed rejects a non-null value; use null")
    if not cfg.enabled:
        return cfg
    for key, (default, what) in _UNBUILT_VALUES.items():
        if getattr(cfg, key) != default:
            raise unbuilt(f"expert_parallel.{key}", what)
    if zero_stage == 3:
        raise DeepSpeedConfigError("Config key 'expert_parallel.enabled' (AutoEP) works with "
                                   "'zero_optimization.stage' 0, 1 or 2, got 3: experts are split by expert "
                                   "parallelism, not by ZeRO-3")
    if autotp_size > 1:
        raise DeepSpeedConfigError(f"Config key 'expert_parallel.enabled' (AutoEP) cannot combine with "
                                   f"'tensor_parallel.autotp_size'={autotp_size}: set it to 1 or disable AutoEP")
    return cfg
