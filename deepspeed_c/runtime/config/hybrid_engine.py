"""The `hybrid_engine` section (DeepSpeed 0.19.8's keys and defaults): training and generation in one engine.

`inference_tp_size` must divide the world (its groups are blocks of consecutive ranks inside the data-parallel
group); the section is parsed with the rest of the config, so a bad size fails before the model is touched."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, DeepSpeedConfigModel, parse_section


class HybridEngineConfig(DeepSpeedConfigModel):
    enabled: bool = False
    max_out_tokens: int = Field(512, ge=1)
    inference_tp_size: int = Field(1, ge=1)
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = Field(8, ge=1)
    enable_cuda_graph: bool = False


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def parse_hybrid_engine(param_dict: dict[str, Any]) -> HybridEngineConfig:
    cfg = parse_section(HybridEngineConfig, param_dict.get("hybrid_engine"), "hybrid_engine")
    if cfg.enabled:
        world = _world_size()
        if world % cfg.inference_tp_size != 0:
            raise DeepSpeedConfigError(
                f"Invalid value {cfg.inference_tp_size} for config key 'hybrid_engine.inference_tp_size': it must "
                f"divide the world size ({world}); the inference tensor-parallel groups are blocks of "
                f"{cfg.inference_tp_size} consecutive ranks")
    return cfg
