"""DeepSpeed-Chat's LoRA linear (LinearLayer_LoRA), written for this example: the hybrid engine recognises it by
its `lora_right_weight`, `lora_left_weight` and `lora_scaling` and fuses the update into its generation copy."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class LoRALinear(torch.nn.Module):
    """y = x W^T + b + scaling * (x @ right @ left); W and b frozen, the two factors trained."""

    def __init__(self, linear: torch.nn.Linear, lora_dim: int, lora_alpha: float = 1.0) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.lora_right_weight = torch.nn.Parameter(torch.empty(linear.in_features, lora_dim))
        self.lora_left_weight = torch.nn.Parameter(torch.zeros(lora_dim, linear.out_features))
        torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.lora_scaling = lora_alpha / lora_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_right_weight @ self.lora_left_weight) \
            * self.lora_scaling


def convert_to_lora(model: torch.nn.Module, lora_dim: int, part: str = "layers.") -> torch.nn.Module:
    """Every nn.Linear whose name contains `part` (the decoder layers) becomes a LoRALinear."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and part in n]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, leaf, LoRALinear(getattr(holder, leaf), lora_dim))
    return model
