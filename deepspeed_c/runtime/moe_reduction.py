"""Expert parallelism as the engine sees it: which process group each parameter belongs to.

A model with MoE layers (modules with `set_deepspeed_parallelism`, as DeepSpeed's engine finds them)
has two kinds of trainable parameters. Ordinary ones are replicated over the data-parallel group:
broadcast from its first rank at start, gradients averaged over it. Expert parameters (marked
`allreduce = False`, `group_name = "ep_size_{n}"`) differ between the ranks of an expert-parallel
group and are replicated only over their expert-data-parallel group: broadcast from that group's
first rank, gradients summed over that group and divided by the data-parallel world size, as
DeepSpeed does, so an expert's gradient is the same average over all ranks' tokens whatever ep_size
is. This collaborator creates the groups (through each layer's set_deepspeed_parallelism), answers
where a parameter is broadcast from, and splits parameters into reduction sets; the engine and the
ZeRO glue ask it and never look at parameter marks themselves. No MoE layer: one set, the old path."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.runtime.backward_round import BucketOrderKeeping


def is_expert_param(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False


@dataclass
class ReductionSet:
    """Parameters reduced together: over `group` (None: the data-parallel group), averaged by
    dp_world_size; `name` is the expert group name, or None for the ordinary parameters."""
    name: Optional[str]
    group: Any
    params: list[torch.nn.Parameter]


class ExpertParallelism:

    def __init__(self, model: torch.nn.Module, use_data_before_expert_parallel_: bool = False,
                 distributed: bool = True) -> None:
        self.layers = [m for m in model.modules() if hasattr(m, "set_deepspeed_parallelism")
                       and hasattr(m, "expert_group_name")]
        self.has_moe_layers = bool(self.layers)
        self.num_experts = [m.num_experts for m in self.layers]
        if self.has_moe_layers and distributed:
            for m in self.layers:
                m.set_deepspeed_parallelism(use_data_before_expert_parallel_)

    def expert_data_parallel_group(self, name: str) -> Any:
        from deepspeed_c.utils import groups

        return groups._get_expert_data_parallel_group(name)

    def broadcast_group(self, p: torch.nn.Parameter, dp_group: Any) -> Any:
        """The group p is replicated over (broadcast from its first rank)."""
        return self.expert_data_parallel_group(p.group_name) if is_expert_param(p) else dp_group

    def reduction_sets(self, params: Sequence[torch.nn.Parameter], dp_group: Any) -> list[ReductionSet]:
        """Ordinary parameters first (if any), then one set per expert group name, in first-seen order."""
        dense = [p for p in params if not is_expert_param(p)]
        sets = [ReductionSet(None, dp_group, dense)] if dense else []
        names: list[str] = []
        for p in params:
            if is_expert_param(p) and p.group_name not in names:
                names.append(p.group_name)
        for name in names:
            sets.append(ReductionSet(name, self.expert_data_parallel_group(name),
                                     [p for p in params if is_expert_param(p) and p.group_name == name]))
        return sets


    def norm_across_ranks(self, dp_group: Any, dp_world_size: int,
                          device: Any = None) -> Optional[Callable[[Any], Any]]:
        """DeepSpeed's stage-0 gradient norm with MoE layers: each rank's norm (its own experts included)
        averaged over the data-parallel group (a float, or a device tensor kept on the device); None
        without MoE layers (every rank's norm is equal)."""
        if not self.has_moe_layers or dp_world_size <= 1:
            return None

        def average(norm: Any) -> Any:
            import deepspeed_c.comm as dist

            if isinstance(norm, torch.Tensor):
                t = norm.detach().to(torch.float32).reshape(1) / dp_world_size
                dist.all_reduce(t, group=dp_group)
                return t.reshape(norm.shape)
            t = torch.tensor([norm / dp_world_size], dtype=torch.float64, device=device)
            dist.all_reduce(t, group=dp_group)
            return float(t.item())

        return average


class ReducerSet(BucketOrderKeeping):
    """Several gradient reducers behaving as one (the engine's reducer protocol)."""

    def __init__(self, reducers: Sequence[Any]) -> None:
        self.reducers = list(reducers)

    def order_keepers(self) -> list[Any]:
        return list(self.reducers)

    def grads_released(self) -> None:
        for r in self.reducers:
            if hasattr(r, "grads_released"):
                r.grads_released()

    def set_gradient_average(self, average: bool) -> None:
        for r in self.reducers:
            if hasattr(r, "set_gradient_average"):
                r.set_gradient_average(average)

    def claim_round(self) -> None:
        for r in self.reducers:
            r.claim_round()

    def end_backward(self) -> None:
        for r in self.reducers:
            r.end_backward()

    def remove(self) -> None:
        for r in self.reducers:
            r.remove()

    def register_inert_hook_test(self, is_inert: Callable[[Any], bool]) -> None:
        for r in self.reducers:
            r.register_inert_hook_test(is_inert)

    @property
    def collectives(self) -> int:
        return sum(r.collectives for r in self.reducers)
