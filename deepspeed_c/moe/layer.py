"""deepspeed.moe.layer.MoE: the user-facing Mixture-of-Experts layer, with DeepSpeed's signature.

forward(hidden_states, used_token=None) returns (output, l_aux, exp_counts). With use_residual (PR-MoE)
the output is mixed with a dense MLP's by a learned, softmaxed two-way coefficient per token."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from deepspeed_c.moe.experts import Experts
from deepspeed_c.moe.sharded_moe import MOELayer, TopKGate, check_gate_args
from deepspeed_c.utils import groups
from deepspeed_c.utils.logging import log_dist


class MoEConfigError(ValueError, AssertionError):
    """A bad MoE argument (a ValueError; also an AssertionError, which DeepSpeed raises for these)."""


class MoE(nn.Module):

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not isinstance(ep_size, int) or ep_size < 1:
            raise MoEConfigError(f"ep_size must be a positive int, got {ep_size!r}")
        if not isinstance(num_experts, int) or num_experts < 1:
            raise MoEConfigError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % ep_size != 0:
            raise MoEConfigError(f"Number of experts ({num_experts}) should be divisible by expert parallel size "
                                 f"(ep_size={ep_size})")
        try:
            check_gate_args(num_experts, k, noisy_gate_policy)
        except ValueError as e:
            raise MoEConfigError(str(e)) from None
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log_dist(f"Creating MoE layer with num_experts: {num_experts} | num_local_experts: {self.num_local_experts} "
                 f"| expert_parallel_size: {ep_size}", [0])
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                                               min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                                               top2_2nd_expert_sampling),
                                      experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # weights of (experts, mlp) per token

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
