"""The whole model's gradient norm under tensor parallelism a client brings.

DeepSpeed's rule (runtime/utils.py clip_grad_norm_ and ZeRO's get_grad_norm_direct): a parameter the
model splits across the tensor-parallel ranks (`is_model_parallel_parameter`: a true `model_parallel`
or `tensor_model_parallel` attribute, as Megatron's layers set) counts on every rank, one replicated
over them (layer norms, a row-parallel bias) only on tensor rank 0, and the squares are summed over
the group. deepspeed_c marks the split parameters with its own `ds_is_tensor_model_parallel` (what
AutoTP's layers set), so ZeRO's partitioned norm and the stage-0 norm below read one attribute."""
from __future__ import annotations

from typing import Any, Callable

import torch

from deepspeed_c.runtime.utils import is_model_parallel_parameter  # DeepSpeed's predicate

__all__ = ["counted_in_norm", "is_model_parallel_parameter", "mark_tensor_parallel_params",
           "tensor_parallel_norm_fn"]


def mark_tensor_parallel_params(module: torch.nn.Module) -> int:
    """Sets ds_is_tensor_model_parallel on every parameter DeepSpeed counts as split; returns how many."""
    count = 0
    for p in module.parameters():
        split = is_model_parallel_parameter(p) or bool(getattr(p, "ds_is_tensor_model_parallel", False))
        p.ds_is_tensor_model_parallel = split
        count += int(split)
    return count


def tensor_parallel_norm_fn(module: torch.nn.Module, group: Any) -> Callable[[Any], Any]:
    """A replacement for the rank-local gradient norm of data-parallel-reduced gradients: split
    parameters' squares summed over `group`, replicated ones counted once (their gradients are equal
    on every tensor rank). Returns a float, or a float32 tensor like its argument when handed one (a
    fused device step takes its norm as a tensor)."""
    params = [p for p in module.parameters() if p.requires_grad]
    split = [p for p in params if getattr(p, "ds_is_tensor_model_parallel", False)]
    replicated = [p for p in params if not getattr(p, "ds_is_tensor_model_parallel", False)]

    def squares(ps: list) -> torch.Tensor:
        out = torch.zeros((), dtype=torch.float64)
        for p in ps:
            if p.grad is not None:
                out += torch.linalg.vector_norm(p.grad.detach(), 2.0, dtype=torch.float64).cpu() ** 2
        return out

    def norm(local: Any) -> Any:
        import deepspeed_c.comm as dist
        from deepspeed_c.comm import collective_device

        sq = squares(split).to(collective_device()).reshape(1)
        dist.all_reduce(sq, group=group)
        value = float((sq.cpu()[0] + squares(replicated)) ** 0.5)
        if isinstance(local, torch.Tensor):
            return torch.full_like(local, value, dtype=torch.float32)
        return value

    return norm


def counted_in_norm(p: torch.Tensor, tensor_rank: int) -> bool:
    """Whether a pipeline stage counts `p`'s gradient in the whole model's norm: not a tied copy a later
    stage holds (ds_pipe_replicated: the first stage of the tie counts it), and, under tensor
    parallelism, a replicated parameter only on tensor rank 0 (DeepSpeed's rule, above)."""
    if getattr(p, "ds_pipe_replicated", False):
        return False
    return tensor_rank == 0 or is_model_parallel_parameter(p) or bool(getattr(p, "ds_is_tensor_model_parallel", False))
