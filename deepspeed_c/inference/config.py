"""deepspeed.inference.config: the typed `init_inference` config, DeepSpeed's keys, aliases and defaults.

Parsed once (from a dict, a JSON file path and/or keyword arguments) into DeepSpeedInferenceConfig;
the engine and the kernel-injection hook read only these objects. Unknown keys raise naming the closest
valid key; keys DeepSpeed accepts for capabilities not built here raise NotImplementedError naming them
when they ask for something (a non-default value)."""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Union

import torch
from pydantic import Field, field_validator, model_validator

from deepspeed_c.runtime.config.utils import DeepSpeedConfigModel, parse_section, unbuilt

# dtypes init_inference converts a model to; int8 is DeepSpeed's weight-quantization spelling
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_SPELLINGS: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
    "int8": torch.int8, "torch.int8": torch.int8,
}


class DeepSpeedTPConfig(DeepSpeedConfigModel):
    """tensor_parallel: how many ranks share one copy of the model (and optionally the group they form)."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = Field(64, ge=1)  # DeepSpeed's uneven-split grain; our splits are even (see README)
    mpu: object = None
    tp_group: object = None


class InferenceCheckpointConfig(DeepSpeedConfigModel):
    checkpoint_dir: Optional[str] = None
    save_mp_checkpoint_path: Optional[str] = None
    base_dir: Optional[str] = None


class DeepSpeedInferenceConfig(DeepSpeedConfigModel):
    """The keys of deepspeed.init_inference (DeepSpeed 0.19.8 names, aliases and defaults)."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    dtype: Any = torch.float16
    tensor_parallel: DeepSpeedTPConfig = Field(default_factory=DeepSpeedTPConfig, alias="tp")
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: dict = Field(default_factory=dict)
    triangular_masking: bool = Field(True, alias="tm")
    moe: Union[bool, dict] = Field(default_factory=dict)
    keep_module_on_host: bool = False
    quant: dict = Field(default_factory=dict)
    checkpoint: Optional[Union[str, dict]] = None
    base_dir: str = ""
    set_empty_params: bool = False
    save_mp_checkpoint_path: Optional[str] = None
    checkpoint_config: InferenceCheckpointConfig = Field(default_factory=InferenceCheckpointConfig,
                                                         alias="ckpt_config")
    return_tuple: bool = True
    training_mp_size: int = 1
    replace_method: str = "auto"  # deprecated in DeepSpeed: accepted, no effect
    injection_policy: Optional[dict] = Field(None, alias="injection_dict")
    injection_policy_tuple: Optional[tuple] = None
    config: Optional[dict] = Field(None, alias="args")
    max_out_tokens: int = Field(1024, alias="max_tokens")
    min_out_tokens: int = Field(1, alias="min_tokens")
    transposed_mode: bool = False
    # deprecated spellings DeepSpeed still accepts
    mp_size: int = 1
    mpu: object = None
    ep_size: int = 1
    ep_group: object = Field(None, alias="expert_group")
    ep_mp_group: object = Field(None, alias="expert_mp_group")
    moe_experts: list = Field(default_factory=lambda: [1])
    moe_type: str = "standard"

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:
        dtype = value if isinstance(value, torch.dtype) else _DTYPE_SPELLINGS.get(str(value).lower()) \
            if isinstance(value, str) else None
        if dtype is None or dtype not in SUPPORTED_DTYPES + (torch.int8,):
            raise ValueError(f"dtype={value!r} is not supported by init_inference: expected torch.float32, "
                             "torch.float16, torch.bfloat16 (or 'fp32', 'fp16', 'bf16') or torch.int8 (int8 weights)")
        return dtype

    @field_validator("max_out_tokens")
    @classmethod
    def _max_out(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"max_out_tokens={value} must be > 0 (prompt plus generated tokens the engine serves)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "DeepSpeedInferenceConfig":
        if self.min_out_tokens < 1 or self.min_out_tokens > self.max_out_tokens:
            raise ValueError(f"min_out_tokens={self.min_out_tokens} must be between 1 and max_out_tokens="
                             f"{self.max_out_tokens}")
        if self.mp_size != 1 and self.tensor_parallel.tp_size == 1:
            # legacy spelling: DeepSpeed moves mp_size to tensor_parallel.tp_size
            self.tensor_parallel.tp_size = self.mp_size
        elif self.mp_size != 1 and self.mp_size != self.tensor_parallel.tp_size:
            raise ValueError(f"mp_size={self.mp_size} conflicts with tensor_parallel.tp_size="
                             f"{self.tensor_parallel.tp_size}; give only tensor_parallel.tp_size")
        if self.mpu is not None and self.tensor_parallel.mpu is None:
            self.tensor_parallel.mpu = self.mpu
        return self


def _unbuilt_keys(cfg: DeepSpeedInferenceConfig) -> None:
    """Keys DeepSpeed accepts whose capability is not built here: a non-default value raises."""
    asks = {
        "use_triton": (cfg.use_triton, "Triton inference kernels"),
        "triton_autotune": (cfg.triton_autotune, "Triton kernel autotuning"),
    }
    for key, (asked, what) in asks.items():
        if asked:
            raise unbuilt(key, what)


def build_config(config: Union[None, str, Mapping[str, Any]], kwargs: Mapping[str, Any]) -> DeepSpeedInferenceConfig:
    """DeepSpeed's merge: the config (dict or JSON path) updated by kwargs; a key given in both with two
    different values raises naming it."""
    if config is None:
        data: dict = {}
    elif isinstance(config, str):
        with open(config, "r") as f:
            data = json.load(f)
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise ValueError(f"'config' argument expected string or dictionary, got {type(config)}")
    for key in set(data) & set(kwargs):
        if data[key] != kwargs[key]:
            raise ValueError(f"Conflicting argument '{key}' in 'config':{data[key]} and kwargs:{kwargs[key]}")
    data.update(kwargs)
    tp = data.get("tensor_parallel", data.get("tp"))
    if isinstance(tp, DeepSpeedTPConfig):  # a typed section passed through
        data["tensor_parallel" if "tensor_parallel" in data else "tp"] = tp.model_dump()
    if data.get("replace_method") == "auto":  # its default, not a Hugging Face "auto" placeholder
        del data["replace_method"]
    cfg = parse_section(DeepSpeedInferenceConfig, data, "init_inference")
    _unbuilt_keys(cfg)
    return cfg
