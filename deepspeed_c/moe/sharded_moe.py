"""deepspeed.moe.sharded_moe: the gate (TopKGate), the layer that dispatches tokens to experts and
combines their outputs (MOELayer), and DeepSpeed's functional gates (top1gating, top2gating,
topkgating). The routing math is in deepspeed_c/moe/gating.py, the moves in the C/CUDA core
(deepspeed_c/moe/gating_core.py): no [tokens, experts, capacity] tensor is built on the layer's path.
With ep_size > 1 one all_to_all_single before and one after the experts carry each expert's
capacity buffer to the rank that holds it and back. That exchange's backward is its own autograd node again
(create_graph keeps the second-order terms); under a torch.func transform it runs as a Function torch.func
can carry (setup_context and a vmap rule)."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module

from deepspeed_c.moe import gating_core as core
from deepspeed_c.moe.gating import (NOISY_GATE_POLICIES, Routing, capacity_for, dense_combine_weights, gumbel_rsample,
                                    multiplicative_jitter, route_top1, route_top2, route_topk)
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.utils.logging import logger

__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "gumbel_rsample",
           "multiplicative_jitter", "_AllToAll", "_capacity"]

TOPK_GATE_TIMER = "topk_gate"
MOE_TIMER = "moe"
FIRST_ALLTOALL_TIMER = "1st_a2a"
SECOND_ALLTOALL_TIMER = "2nd_a2a"
TUTEL_INSTALLED = False


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    num_tokens, num_experts = gates.shape
    return torch.tensor(capacity_for(num_tokens, num_experts, float(capacity_factor), int(min_capacity)))


class _AllToAllNode(torch.autograd.Function):
    """_AllToAll's autograd node (see _AllToAll)."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # noqa: A002 (DeepSpeed's name)
        import deepspeed_c.comm as dist

        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAllNode.apply(ctx.group, *grad_output)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits; its gradient is the same exchange back."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, group: Any, input: Tensor) -> Tensor:  # type: ignore[override]  # noqa: A002
        if not torch.compiler.is_compiling() and transforms_active():
            return _FuncAllToAll.apply(group, input)
        return _AllToAllNode.apply(group, input)


def _exchange(group: Any, input: Tensor) -> Tensor:  # noqa: A002
    import deepspeed_c.comm as dist

    input = input.contiguous()
    output = torch.empty_like(input)
    dist.all_to_all_single(output, input, group=group)
    return output


class _FuncAllToAll(torch.autograd.Function):
    """The same exchange for torch.func (grad, vmap, their compositions)."""

    @staticmethod
    def forward(group: Any, input: Tensor) -> Tensor:  # type: ignore[override]  # noqa: A002
        return _exchange(group, input)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, _FuncAllToAll.apply(ctx.group, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, input: Tensor) -> tuple:  # noqa: A002
        # the exchange splits dimension 0: the vmapped dimension goes second (every rank vmaps the same size)
        if in_dims[1] is None:
            return _FuncAllToAll.apply(group, input), None
        return _FuncAllToAll.apply(group, input.movedim(in_dims[1], 1)), 1


def _sparse_tuple(r: Routing) -> tuple:
    """DeepSpeed's sparse_routes answer: (l_aux, capacity, E, indices [k, S] int32 (-1 dropped),
    locations [k, S] int32 (0 dropped), gates [k, S], exp_counts)."""
    kept = r.route_slot >= 0
    indices = torch.where(kept, r.idx, torch.full_like(r.idx, -1))
    locations = torch.where(kept, r.locations, torch.zeros_like(r.idx))
    return (r.l_aux, torch.tensor(r.capacity), r.num_experts, indices.t().to(torch.int32).contiguous(),
            locations.t().to(torch.int32).contiguous(), r.weights.t().contiguous(), r.exp_counts)


def _dense_tuple(r: Routing) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cw, mask = dense_combine_weights(r)
    return r.l_aux, cw, mask, r.exp_counts


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False) -> tuple:
    """Top-1 gating: (l_aux, combine_weights [S, E, C], dispatch_mask, exp_counts) as DeepSpeed's."""
    r = route_top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts, ep_group)
    return _sparse_tuple(r) if sparse_routes else _dense_tuple(r)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False) -> tuple:
    r = route_top2(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling)
    return _sparse_tuple(r) if sparse_routes else _dense_tuple(r)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False) -> tuple:
    r = route_topk(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)
    return _sparse_tuple(r) if sparse_routes else _dense_tuple(r)


def check_gate_args(num_experts: int, k: int, noisy_gate_policy: Optional[str]) -> None:
    if not isinstance(k, int) or k < 1 or k > num_experts:
        raise ValueError(f"k={k!r} must be an int between 1 and num_experts={num_experts}")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy!r}; valid options are 'Jitter', "
                         "'RSample' or None")


class TopKGate(Module):
    """The gate: a bias-free linear layer to num_experts logits (in fp32), then top-k routing."""

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Union[Any, None] = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        check_gate_args(num_experts, k, noisy_gate_policy)
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None:
            raise AssertionError("Attempting to override an existing ep_group")
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Optional[Tensor] = None) -> Routing:  # noqa: A002
        """The routing of a [tokens, model_dim] input (what MOELayer uses)."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = F.linear(x, weight=self.wg.weight.float(), bias=None)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return route_top1(logits, cf, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group)
        if self.k == 2:
            return route_top2(logits, cf, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling)
        return route_topk(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group)

    def forward(self, input: Tensor, used_token: Tensor = None, sparse_routes: bool = False,  # noqa: A002
                use_tutel: bool = False) -> tuple:
        r = self.route(input, used_token)
        return _sparse_tuple(r) if sparse_routes else _dense_tuple(r)


class MOELayer(Module):
    """Routes tokens with the gate, runs the experts (across the expert-parallel group when
    ep_size > 1) and combines their outputs weighted by the gates."""

    def __init__(self, gate: Module, experts: Module, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.wall_clock_breakdown = False
        self.use_tutel = False
        if use_tutel:
            logger.warning("Tutel optimization requested but not installed. Proceeding without Tutel.")

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:  # noqa: A002
        d_model = input[0].shape[-1]
        x = input[0].reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        r: Routing = self.gate.route(x, used_token)
        self.l_aux, self.exp_counts = r.l_aux, r.exp_counts
        E, C = r.num_experts, r.capacity
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: call "
                               "set_deepspeed_parallelism() on the MoE layer (deepspeed.initialize does)")
        dispatched = core.dispatch(x, r.route_slot, r.slot_route).view(E, C, d_model)
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(self.ep_group, dispatched)
        # rows grouped as [ep rank of origin, local expert, capacity, model]
        expert_output = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model))
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if self.ep_size > 1:
            expert_output = _AllToAll.apply(self.ep_group, expert_output)
        combined = core.combine(expert_output.reshape(E * C, d_model), r.weights, r.route_slot, r.slot_route)
        return combined.reshape(input[0].shape)
