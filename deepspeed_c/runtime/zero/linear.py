"""ZeRO-3's memory-efficient Linear (zero_optimization.memory_efficient_linear, on by default as in
DeepSpeed).

torch's linear records `weight.t()` for its backward: a view of the gathered buffer the parameter
points at during forward. ZeRO-3 releases a module's gathered parameters after its forward by
pointing them back at empty placeholders, but that saved view keeps the whole gathered buffer
alive until the backward, so a model of Linear layers would hold every layer's full weights from
forward to backward (ZeRO-2's memory). This Function saves the parameter itself instead: in the
backward it reads whatever the parameter points at then, which ZeRO-3's pre-backward gather has
made the full weight again. The forward is torch's linear itself (same numbers); the backward
computes the three products autograd would.

A parameter not gathered again before its backward reaches this Function as a placeholder and
fails with a shape error naming it, never reads freed memory."""
from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.nn.functional as F

from deepspeed_c.runtime import autograd_paths
from deepspeed_c.runtime.zero.param_store import ZeroParamStatus


class LinearFunctionForZeroStage3(torch.autograd.Function):  # DeepSpeed's name

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - torch's argument name
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        input, weight, bias = ctx.saved_tensors  # noqa: A001
        if weight.numel() == 0:
            raise RuntimeError(
                f"ZeRO-3 memory_efficient_linear: a Linear weight (ds_id {getattr(weight, 'ds_id', '?')}, shape "
                f"{tuple(getattr(weight, 'ds_shape', weight.shape))}) was not gathered before its backward; "
                "a parameter used outside the module that owns it must be registered with "
                "deepspeed_c.zero.register_external_parameter, or set memory_efficient_linear to false")
        grad_input = grad_weight = grad_bias = None
        if torch.is_grad_enabled():
            # create_graph: the graph being built keeps what it multiplies by until its own backward, when
            # the parameter may be a placeholder again; a view holds the gathered weight (as torch's
            # linear holds `weight.t()`) and still passes gradients on to the parameter
            weight = weight.view_as(weight)
        dtype = grad_output.dtype  # a cast only where the dtypes differ (`.to` of the same dtype is the tensor itself)
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight if weight.dtype == dtype else weight.to(dtype))
        out_features = grad_output.shape[-1]
        flat_grad = grad_output.reshape(-1, out_features)
        if ctx.needs_input_grad[1]:
            flat_input = input.reshape(-1, input.shape[-1])
            grad_weight = flat_grad.t().matmul(flat_input if flat_input.dtype == dtype else flat_input.to(dtype))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear with LinearFunctionForZeroStage3's backward (DeepSpeed's name). Under autocast the
    weight is cast anyway (the cast copy is what autograd saves), so torch's linear runs as it is; under
torch.func transforms (which would need a vmap rule for this Function) too."""
    if torch.is_autocast_enabled(input.device.type) or not torch.is_grad_enabled() or \
            autograd_paths.transforms_active():
        return F.linear(input, weight, bias)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


_DIRECT = autograd_paths.direct_apply(LinearFunctionForZeroStage3)
_unwrap = autograd_paths.unwrap_if_dead
_get = dict.get
_ABSENT = object()
_AVAILABLE = ZeroParamStatus.AVAILABLE
# `_parameters` types whose item read returns a gathered parameter as dict.get does (param_hooks adds ZeroParamDict)
PLAIN_READ_DICTS: set[type] = {dict}


def _efficient_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """zero3_linear_wrap for eager execution, which calls it hundreds of times a step: the weight and bias read
    from the parameter dict (one call less than the module attribute: a parametrized weight is not in it and
    goes through the attribute) and the Function applied without torch's Python prelude. Dynamo does not trace
    that: before it compiles, use_traced puts _traced_forward in its place (compile_hooks.py)."""
    params = self._parameters
    # a gathered parameter in a dict whose read is the plain dict read: no Python frame (ZeroParamDict's read
    # only acts on a parameter not gathered, and that one still goes through it)
    plain = type(params) in PLAIN_READ_DICTS
    weight = _get(params, "weight", _ABSENT)
    if weight is _ABSENT:
        weight = self.weight
    elif not plain or (weight is not None and getattr(weight, "ds_status", _AVAILABLE) is not _AVAILABLE):
        weight = params["weight"]
    bias = _get(params, "bias", _ABSENT)
    if bias is _ABSENT:
        bias = self.bias
    elif not plain or (bias is not None and getattr(bias, "ds_status", _AVAILABLE) is not _AVAILABLE):
        bias = params["bias"]
    if torch.is_autocast_enabled(input.device.type) or not torch.is_grad_enabled() or \
            torch._C._are_functorch_transforms_active():
        return F.linear(input, weight, bias)
    # a parameter is never a dead functorch wrapper (under a transform torch's linear runs, above); an input can be
    return _DIRECT(_unwrap(input), weight, bias)


def _traced_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return zero3_linear_wrap(input, self.weight, self.bias)


# a pickled bound method is rebuilt as getattr(module, __name__): "forward" finds the module's forward
_efficient_forward.__name__ = _traced_forward.__name__ = "forward"


def install(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every torch.nn.Linear of `module` whose forward is torch's own runs through
    zero3_linear_wrap (an instance attribute, so hooks and the class stay as they are); returns them
    for `uninstall`."""
    changed = []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward and \
                "forward" not in m.__dict__:
            m.forward = types.MethodType(_efficient_forward, m)
            changed.append(m)
    return changed


def use_traced(modules: list[torch.nn.Linear]) -> None:
    """The forward dynamo can trace (LinearFunctionForZeroStage3.apply) in place of the eager one."""
    for m in modules:
        f = m.__dict__.get("forward")
        if f is not None and getattr(f, "__func__", None) is _efficient_forward:
            m.forward = types.MethodType(_traced_forward, m)


def uninstall(modules: list[torch.nn.Linear]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)
