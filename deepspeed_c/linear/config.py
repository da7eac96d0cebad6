"""The two configs of deepspeed.linear (DeepSpeed's dataclasses, same fields and defaults). Values are
checked when a config is made and again when a layer uses it, since callers may set fields afterwards."""
from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Real
from typing import List

import torch

from deepspeed_c.ops.fp_quantizer import minifloat

_LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class LoRAConfig:
    """LoRA for LoRAOptimizedLinear.

    lora_r: rank of the adapter (64). lora_alpha: the adapter's output is scaled by lora_alpha / lora_r (16).
    base_weight_sharding: how many ranks the frozen base weight is split over; 1 keeps it whole, >1 must equal
    the world size (1). offload / offload_ratio: move that share of the frozen base weights to the CPU between
    uses (False, 0.0). delay_lora_init: build the adapters later with init_lora (False). target_mods: module
    names (substrings of the state-dict prefix) that keep LoRA when a state dict is loaded; others turn into a
    plain frozen linear (Llama's projections).
    """
    lora_r: int = 64
    lora_alpha: float = 16.
    base_weight_sharding: int = 1
    offload: bool = False
    offload_ratio: float = 0.0
    delay_lora_init: bool = False
    target_mods: List[str] = field(default_factory=lambda: list(_LLAMA_PROJECTIONS))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.lora_r) or self.lora_r <= 0:
            raise ValueError(f"LoRAConfig.lora_r must be a positive int, got {self.lora_r!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, Real):
            raise TypeError(f"LoRAConfig.lora_alpha must be a number, got {type(self.lora_alpha).__name__}")
        if not _is_int(self.base_weight_sharding) or self.base_weight_sharding < 1:
            raise ValueError(f"LoRAConfig.base_weight_sharding must be an int >= 1, got {self.base_weight_sharding!r}")
        for name in ("offload", "delay_lora_init"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LoRAConfig.{name} must be a bool, got {getattr(self, name)!r}")
        ratio = self.offload_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, Real) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"LoRAConfig.offload_ratio must be a number in [0, 1], got {ratio!r}")
        mods = self.target_mods
        # a bare string would be searched character by character
        if isinstance(mods, str) or not isinstance(mods, (list, tuple)) or \
                not all(isinstance(m, str) and m for m in mods):
            raise TypeError(f"LoRAConfig.target_mods must be a list of non-empty module-name strings, "
                            f"got {mods!r}")


@dataclass
class QuantizationConfig:
    """Quantization of the frozen base weight (QuantizedParameter, QuantizedLinear, LoRAOptimizedLinear).

    q_bits: bits per value, 4, 6, 8 or 12 (8). mantissa_bits: mantissa bits of an 8-bit code, 3 for E4M3 or 2
    for E5M2 (3); 12, 6 and 4 bits always use E7M4, E3M2 and E2M1. group_size: values sharing one scale (512).
    q_dtype: storage dtype of the quantized bytes, torch.uint8.
    """
    q_bits: int = 8
    mantissa_bits: int = 3
    group_size: int = 512
    q_dtype: torch.dtype = torch.uint8

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        minifloat.code_format(self.q_bits, self.mantissa_bits)
        minifloat.check_group_size(self.group_size, self.q_bits)
        if self.q_dtype != torch.uint8:
            raise ValueError(f"QuantizationConfig.q_dtype must be torch.uint8 (quantized values are stored as "
                             f"packed bytes), got {self.q_dtype!r}")
