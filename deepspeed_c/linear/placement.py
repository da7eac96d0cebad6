"""Where OptimizedLinear base weights live during training (what DeepSpeed's engine does at initialize):
LoRAConfig.offload_ratio of the frozen base-weight elements, taken in module order, is parked on the CPU
(`ds_offload`) and brought to the accelerator only for the forward that uses it."""
from __future__ import annotations

import torch

from .optimized_linear import LoRAOptimizedLinear


def place_base_weights(module: torch.nn.Module) -> tuple[bool, bool]:
    """Mark and move the base weights; returns (any LoRAOptimizedLinear, any with base-weight sharding)."""
    lora = [m for m in module.modules() if isinstance(m, LoRAOptimizedLinear)]
    if not lora:
        return False, False
    ratios = {m.lora_config.offload_ratio for m in lora}
    if len(ratios) > 1:
        raise ValueError(f"LoRAConfig.offload_ratio must be the same for every OptimizedLinear of the model, "
                         f"got {sorted(ratios)}")
    frozen = [p for p in module.parameters() if hasattr(p, "ds_optim_param")]
    limit = sum(p.numel() for p in frozen) * ratios.pop()
    moved = 0
    for p in frozen:
        p.ds_offload = moved < limit
        if p.ds_offload:
            moved += p.numel()
            p.data = p.data.to("cpu")
    return True, any(m.zero_shards > 1 for m in lora)

