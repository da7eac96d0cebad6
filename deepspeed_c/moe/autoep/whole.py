"""The whole expert tensors of AutoEP layers split over ranks, for exports that must hold the unsplit model
(save_16bit_model: a file Hugging Face's from_pretrained / load_state_dict reads as the original model)."""
from __future__ import annotations

from typing import Any

import torch


def split_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """(path, layer) of every AutoEP experts module whose experts are split over more than one rank."""
    from deepspeed_c.moe.autoep.layer import AutoEPExperts

    return [(n, m) for n, m in module.named_modules() if isinstance(m, AutoEPExperts) and m.ep_size > 1]


def _gathered(t: torch.Tensor, layer: Any) -> torch.Tensor:
    """t of every rank of the layer's expert-parallel group, stacked in expert order (by ep_rank)."""
    import deepspeed_c.comm as dist

    group = layer.ep_group
    parts = [torch.empty_like(t) for _ in range(layer.ep_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    ranks = [torch.zeros(1, dtype=torch.long, device=t.device) for _ in range(layer.ep_size)]
    dist.all_gather(ranks, torch.tensor([layer.ep_rank], device=t.device), group=group)
    order = sorted(range(layer.ep_size), key=lambda i: int(ranks[i]))
    return torch.cat([parts[i] for i in order])


def with_whole_experts(module: torch.nn.Module, sd: dict, prefix: str = "") -> dict:
    """sd with each split layer's fused expert tensors replaced by all the layer's experts. Collective over each
    layer's expert-parallel group: every rank calls it."""
    for path, layer in split_layers(module):
        for name in (layer.w1_name, layer.w2_name):
            whole = _gathered(getattr(layer, name).detach(), layer)
            key = f"{prefix}{path}.{name}" if path else f"{prefix}{name}"
            if key in sd:  # absent when the caller excluded frozen parameters
                sd[key] = whole
    return sd
