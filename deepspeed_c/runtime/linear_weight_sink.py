"""torch.nn.Linear with a say over its weight gradient: the mechanism under ZeRO-1/2's in-place gradients
(runtime/zero/bucket_linear.py) and ZB-H1's deferred weight gradients (runtime/pipe/deferred_wgrad.py).

`install(module, sink, accept)` gives every accepted torch.nn.Linear of `module` (torch's own forward) an
instance forward that runs LinearWithWeightSink: torch's linear forward, and a backward computing the
products autograd would, except that the weight gradient is asked of the sink,
`sink.weight_grad(param, flat_input, flat_grad_output, node)` (`node`: where the weight's gradient goes,
its AccumulateGrad), which either returns it (autograd accumulates it as usual) or takes care of it and
returns None. The sink is asked only with grad mode off: under `create_graph` the weight gradient must be
a differentiable product, so it is computed here (runtime/autograd_paths.py has the rule). One sink per
module at a time: installing again replaces it. Under autocast, without grad, while torch.compile traces,
under torch.func transforms, for a frozen weight or once the sink is uninstalled, Linear runs as torch's."""
from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from deepspeed_c.runtime import autograd_paths

# module -> its sink (no attribute on the module: it stays picklable and deep-copyable)
_SINKS: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


class LinearWithWeightSink(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - torch's argument name
                bias: Optional[torch.Tensor], sink: Any) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias, ctx.sink = bias is not None, sink
        # the Parameter itself: under non-reentrant activation checkpointing the saved weight comes back as
        # another tensor object, which a sink would not know
        ctx.param = weight
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        input, weight = ctx.saved_tensors  # noqa: A001
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            flat_input = input.reshape(-1, input.shape[-1])
            if torch.is_grad_enabled():  # create_graph: the gradient goes into a graph, as autograd's would
                grad_weight = plain_weight_grad(flat_input, flat_grad)
            else:
                grad_weight = ctx.sink.weight_grad(ctx.param, flat_input, flat_grad, ctx.next_functions[1][0])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_input, grad_weight, grad_bias, None


def plain_weight_grad(flat_input: torch.Tensor, flat_grad: torch.Tensor) -> torch.Tensor:
    return flat_grad.t().mm(flat_input)


def _forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    sink = _SINKS.get(self)
    if sink is None or not torch.is_grad_enabled() or not self.weight.requires_grad or \
            torch.is_autocast_enabled(input.device.type) or torch.compiler.is_compiling() or \
            autograd_paths.transforms_active():
        return F.linear(input, self.weight, self.bias)
    return LinearWithWeightSink.apply(input, self.weight, self.bias, sink)


_forward.__name__ = "forward"  # a pickled bound method is rebuilt as getattr(module, "forward")


def _ours(m: torch.nn.Module) -> bool:
    return getattr(m.__dict__.get("forward"), "__func__", None) is _forward


def install(module: torch.nn.Module, sink: Any, accept: Callable[[torch.nn.Linear], bool]) -> list[torch.nn.Linear]:
    """The accepted Linears of `module` ask `sink` for their weight gradients; returns them for uninstall."""
    changed = []
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear) or type(m).forward is not torch.nn.Linear.forward or not accept(m):
            continue
        if "forward" in m.__dict__ and not _ours(m):
            continue  # someone else's instance forward: left alone
        m.forward = types.MethodType(_forward, m)
        _SINKS[m] = sink
        changed.append(m)
    return changed


def uninstall(modules: list[torch.nn.Linear], sink: Any) -> None:
    """Restores torch's forward on those of `modules` whose sink is still `sink`."""
    for m in modules:
        if _SINKS.get(m) is sink:
            del _SINKS[m]
            if _ours(m):
                del m.__dict__["forward"]
