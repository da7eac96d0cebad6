"""Domino's linear layers (DeepSpeed's deepspeed.runtime.domino.async_linear).

DominoAsyncColumnParallelLinear: output features split over the tensor-parallel ranks, input replicated.
Its input gradient is the sum of every rank's partial one; the backward starts that all-reduce
asynchronously, files its handle (handles.py) and computes the weight and bias gradients while it runs.
RowParallelLinearNoComm: input features split; it returns the partial product and leaves the sum to
the caller, who starts it asynchronously and waits only where the sum is read."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from deepspeed_c import comm as dist
from deepspeed_c.accelerator import get_accelerator
from deepspeed_c.module_inject.layers import TPCopy, TPReduce
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.runtime.domino.handles import file_handle

__all__ = ["DominoAsyncColumnParallelLinearImpl", "DominoAsyncColumnParallelLinear", "RowParallelLinearNoComm"]

# DeepSpeed keeps the first layer's group in a module global; ours passes each layer's own group and
# falls back to this one only for a caller applying the Function without a group
TP_group = None


def _world(group: Any) -> int:
    return dist.get_world_size(group=group) if group is not None else 1


class DominoAsyncColumnParallelLinearImpl(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: Optional[torch.Tensor], handle_dic: dict, h_id: Any, group: Any = None) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        ctx.has_bias = bias is not None
        ctx.handle_dic, ctx.h_id = handle_dic, h_id
        ctx.group = group if group is not None else TP_group
        return F.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:  # type: ignore[override]
        inp, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        # create_graph (grad mode on here): the products below are recorded as they run; the input gradient's
        # all-reduce must be too, so it is the synchronous differentiable one and nothing is filed for the wait
        create_graph = torch.is_grad_enabled()
        if create_graph:
            # the graph built here reads the saved input: a later backward through this node (the penalty's)
            # sends a second gradient to that input, which autograd adds to this node's as soon as both exist,
            # before the wait node runs; so from now on its all-reduce completes before it is returned
            ctx.synchronous = True
        tp = _world(ctx.group) > 1
        if need_input:
            grad_input = torch.matmul(grad_output, weight)
            if tp and create_graph:
                grad_input = TPReduce.apply(ctx.group, grad_input)
            elif tp and getattr(ctx, "synchronous", False):
                dist.all_reduce(grad_input, group=ctx.group)
            elif tp:
                # in flight while the weight-gradient GEMM below runs; waited by _Wait_bwd_comm's backward
                file_handle(ctx.handle_dic, ctx.h_id, dist.all_reduce(grad_input, group=ctx.group, async_op=True))
        if tp and create_graph:
            # the input is replicated and feeds this rank's shard: what reaches it through the weight gradient is
            # summed over the group too (the copy's adjoint), as autograd would for copy-then-linear
            inp = TPCopy.apply(ctx.group, inp)
        out_features = grad_output.shape[-1]
        flat_grad = grad_output.reshape(-1, out_features)
        if need_weight:
            grad_weight = flat_grad.t().matmul(inp.reshape(-1, inp.shape[-1]))
        if need_bias and ctx.has_bias:
            grad_bias = flat_grad.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None


def _new_params(output_size: int, input_size: int, config: Any, init_method: Callable, bias: bool,
                split_bias: bool) -> tuple[Parameter, Optional[Parameter]]:
    """The layer's weight (split over the TP ranks) and bias (split or replicated), tagged for the engine's
    gradient norm and ZeRO (`ds_is_tensor_model_parallel`: a shard counts on every TP rank)."""
    device = get_accelerator().current_device_name()
    weight = Parameter(torch.empty(output_size, input_size, device=device, dtype=config.params_dtype))
    if config.perform_initialization:
        init_method(weight)
    weight.ds_is_tensor_model_parallel = True
    if not bias:
        return weight, None
    bias_param = Parameter(torch.zeros(output_size, device=device, dtype=config.params_dtype))
    bias_param.ds_is_tensor_model_parallel = split_bias
    return weight, bias_param


class DominoAsyncColumnParallelLinear(torch.nn.Module):
    """`output_size` is this rank's share of the output features."""

    def __init__(self, input_size: int, output_size: int, _tp_group: Any, config: Any, init_method: Callable,
                 bias: bool = True, skip_bias_add: bool = False) -> None:
        super().__init__()
        global TP_group
        if TP_group is None:
            TP_group = _tp_group
        self.tp_group = _tp_group
        self.skip_bias_add = skip_bias_add
        self.weight, bias_param = _new_params(output_size, input_size, config, init_method, bias, split_bias=True)
        self.register_parameter("bias", bias_param)

    def forward(self, input_: torch.Tensor, handle_dic: dict, h_id: Any) -> tuple:
        bias = None if self.skip_bias_add else self.bias
        if transforms_active():  # torch.func: the same math in differentiable pieces (no async handle to file)
            x = TPCopy.apply(self.tp_group, input_) if _world(self.tp_group) > 1 else input_
            return F.linear(x, self.weight, bias), (self.bias if self.skip_bias_add else None)
        output = DominoAsyncColumnParallelLinearImpl.apply(input_, self.weight, bias, handle_dic, h_id, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinearNoComm(torch.nn.Module):
    """`input_size` is this rank's share of the input features; the output is this rank's partial sum."""

    def __init__(self, input_size: int, output_size: int, config: Any, init_method: Callable, bias: bool = True,
                 stride: int = 1, skip_bias_add: bool = False) -> None:
        super().__init__()
        self.skip_bias_add = skip_bias_add
        # the bias is replicated: added once, after the sum
        self.weight, bias_param = _new_params(output_size, input_size, config, init_method, bias, split_bias=False)
        self.register_parameter("bias", bias_param)

    def forward(self, input_: torch.Tensor) -> tuple:
        bias = None if self.skip_bias_add else self.bias
        return F.linear(input_, self.weight, bias), (self.bias if self.skip_bias_add else None)
