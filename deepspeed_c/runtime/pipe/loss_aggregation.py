"""The batch's losses as the PipelineEngine reports them (DeepSpeed's `_aggregate_total_loss`).

The last stage sums each micro-batch's loss, and each of the module's `get_additional_losses()` (an MoE
model's auxiliary losses, by name), over the batch; here the sums are divided by the accumulation steps,
averaged over the stage's data-parallel ranks in one all-reduce, and broadcast from the last stage to the
others over the pipe group, which learn the names from their own module's `get_additional_losses()` keys
(values there may be None: only the last stage computes them)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.distributed as dist


def add_to_total(total: Any, loss: Any) -> Any:
    """`total` plus the detached `loss` (a tensor, or a list/tuple of tensors added element-wise); None: a copy."""
    if isinstance(loss, torch.Tensor):
        d = loss.detach()
        return d.clone() if total is None else total + d
    if isinstance(loss, (list, tuple)):
        if total is None:
            return [l.detach().clone() for l in loss]
        return [t + l.detach() for t, l in zip(total, loss)]
    raise TypeError(f"a pipeline loss must be a tensor or a list/tuple of tensors, got {type(loss).__name__}")


def _scalar(value: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"the pipeline reports one number per loss: {what} has shape {shape}")
    return value.detach().float().reshape(())


def aggregate(total_loss: Optional[torch.Tensor], total_additional: Optional[dict], gas: int, grid: Any,
              is_last: bool, additional_names: Optional[list], device: Any
              ) -> tuple[torch.Tensor, torch.Tensor, Optional[OrderedDict]]:
    """(this data-parallel rank's loss, the loss averaged over data-parallel ranks, the additional losses
    averaged likewise or None), each per micro-batch, on every stage. `total_*` are the last stage's sums;
    `additional_names` the keys of the module's get_additional_losses() (None when it returns None)."""
    pipe = grid.get_pipe_parallel_world_size() > 1
    if is_last:
        if total_loss is None:
            raise RuntimeError("the last pipeline stage computed no loss this batch")
        local = _scalar(total_loss / gas, "the loss")
        extra = None if total_additional is None else OrderedDict(
            (name, _scalar(v / gas, f"additional loss {name!r}")) for name, v in total_additional.items())
        values = torch.stack([local, local] + (list(extra.values()) if extra else []))
        if grid.get_data_parallel_world_size() > 1:  # one all-reduce for the loss and every additional loss
            averaged = values[1:].clone()
            dist.all_reduce(averaged, group=grid.get_data_parallel_group())
            values[1:] = averaged / grid.get_data_parallel_world_size()
        if pipe:
            dist.broadcast(values, src=grid.stage_to_global(grid.get_pipe_parallel_world_size() - 1),
                           group=grid.get_pipe_parallel_group())
        names = list(extra) if extra is not None else None
    else:
        names = additional_names
        values = torch.zeros(2 + len(names or ()), dtype=torch.float32, device=device)
        dist.broadcast(values, src=grid.stage_to_global(grid.get_pipe_parallel_world_size() - 1),
                       group=grid.get_pipe_parallel_group())
    agg_extra = None if names is None else OrderedDict((n, values[2 + i].clone()) for i, n in enumerate(names))
    return values[0].clone(), values[1].clone(), agg_extra
