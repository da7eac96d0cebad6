"""deepspeed.moe.experts: this rank's local experts, deep copies of one expert module. Their
parameters carry DeepSpeed's marks: `allreduce = False` (not reduced over the whole data-parallel
group) and `group_name` (the expert group, `ep_size_{n}`, whose expert-data-parallel ranks hold the
same experts and reduce their gradients)."""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn


class Experts(nn.Module):

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for param in e.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # inputs: [ep_size, num_local_experts, capacity, model]; expert i takes slice i of dim 1
        outputs = []
        for i, (chunk, expert) in enumerate(zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts)):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]  # (output, bias) experts: the bias is ignored, as in DeepSpeed
            if out.shape != chunk.shape:
                raise ValueError(f"expert {i} ({type(expert).__name__}) returned shape {tuple(out.shape)} for an input "
                                 f"of shape {tuple(chunk.shape)}; an MoE expert must keep its input's shape "
                                 "(hidden_size in and out)")
            outputs.append(out)
        return torch.cat(outputs, dim=1)
