"""Model-parallel compressed linears for Megatron-style models (`init_compression(..., mpu=mpu)`): the
compressed twins of `mpu.ColumnParallelLinear` (weight split by output rows; optional all-gather of the output)
and `mpu.RowParallelLinear` (weight split by input columns; all-reduce of the partial outputs, bias added after),
through torch.distributed on the mpu's model-parallel group. Each rank compresses its own shard (masks and
quantization groups are per shard, as in DeepSpeed)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from deepspeed_c.compression.basic_layer import LinearLayer_Compress
from deepspeed_c.module_inject.layers import TPCopy, TPGatherLast, TPReduce, TPSplitLast
from deepspeed_c.runtime.autograd_paths import transforms_active


def _world(group: Any) -> int:
    return dist.get_world_size(group=group) if dist.is_available() and dist.is_initialized() else 1


class _CopyToRegion(torch.autograd.Function):  # identity forward, all-reduce of the gradient

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if _world(ctx.group) > 1:
            if torch.is_grad_enabled():  # create_graph: the all-reduce stays in the graph (its adjoint: a copy)
                return TPReduce.apply(ctx.group, grad), None
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):  # all-reduce forward, identity backward

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if _world(group) > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and _world(ctx.group) > 1:  # create_graph: a copy whose adjoint all-reduces
            return TPCopy.apply(ctx.group, grad), None
        return grad, None


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.size(-1) % world:
        raise ValueError(f"RowParallelLinear_Compress: the input's last dim {x.size(-1)} does not split over "
                         f"{world} ranks")
    return x.chunk(world, dim=-1)[dist.get_rank(group=group)].contiguous()


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _Scatter(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and _world(ctx.group) > 1:  # create_graph: the gather stays in the graph
            return TPGatherLast.apply(ctx.group, grad), None
        return _gather_last(grad, ctx.group), None


class _Gather(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and _world(ctx.group) > 1:  # create_graph: the split stays in the graph
            return TPSplitLast.apply(ctx.group, grad), None
        return _split_last(grad, ctx.group), None


def _region(fast: type, twin: type, x: torch.Tensor, group: Any) -> torch.Tensor:
    """`fast` (the Functions above); under a torch.func transform its differentiable twin, which has a vmap
    rule (module_inject/layers.py), or nothing on a group of one rank."""
    if not transforms_active():
        return fast.apply(x, group)
    return twin.apply(group, x) if _world(group) > 1 else x


class ColumnParallelLinear_Compress(LinearLayer_Compress):
    """Y = X A with A split by columns (this rank: output_size / world rows of the weight)."""

    def __init__(self, mpu: Any, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 skip_bias_add: bool = False) -> None:
        world = mpu.get_model_parallel_world_size()
        if output_size % world:
            raise ValueError(f"ColumnParallelLinear_Compress: output_size {output_size} does not split over "
                             f"{world} ranks")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.output_size_per_partition = output_size // world
        super().__init__(input_size, self.output_size_per_partition, bias=bias)
        self.mpu = mpu

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # type: ignore[override]
        group = self.mpu.get_model_parallel_group()
        x = _region(_CopyToRegion, TPCopy, input_, group)
        if self.skip_bias_add:
            out, bias = super().forward(x, True)
        else:
            out, bias = super().forward(x), None
        return (_region(_Gather, TPGatherLast, out, group) if self.gather_output else out), bias


class RowParallelLinear_Compress(LinearLayer_Compress):
    """Y = X A with A split by rows (this rank: input_size / world columns of the weight)."""

    def __init__(self, mpu: Any, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 skip_bias_add: bool = False) -> None:
        world = mpu.get_model_parallel_world_size()
        if input_size % world:
            raise ValueError(f"RowParallelLinear_Compress: input_size {input_size} does not split over {world} ranks")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.input_size_per_partition = input_size // world
        super().__init__(self.input_size_per_partition, output_size, bias=bias)
        self.mpu = mpu

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # type: ignore[override]
        group = self.mpu.get_model_parallel_group()
        x = input_ if self.input_is_parallel else _region(_Scatter, TPSplitLast, input_, group)
        out, bias = super().forward(x, True)
        out = _region(_ReduceFromRegion, TPReduce, out, group)
        if self.skip_bias_add:
            return out, bias
        return (out + bias if bias is not None else out), None
