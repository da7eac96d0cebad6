"""Zero-bubble B/W split without a second backward: Linear weight gradients deferred from B to W.

ZB-H1's B pass must produce the stage's input gradients (sent upstream at once) and its W pass the weight
gradients, later. Run as two autograd traversals from the outputs (input gradients first, then the
parameters), the W pass recomputes every activation gradient of the stage on its way to the first layer's
weights: ~1.5 backwards per micro-batch (on 2 H100s, 1.3B GPT, ZB-H1 took 272 ms a step against 1F1B's
235). Here one traversal does it: during B each torch.nn.Linear's backward computes its input gradient and
stashes (input, output gradient) instead of the weight-gradient GEMM; every other parameter's gradient
(norms, biases, embeddings: cheap) is computed in B too and kept. W multiplies the stashed pairs and
accumulates everything into the parameters through autograd (backward on the leaves), so the engine's
reducer hooks see the gradients as they would after a plain backward.

A Linear whose weight carries a tensor hook computes its weight gradient in B (the hook must see it); the
executor uses the two-traversal path for a stage where any trainable parameter carries a tensor hook (a
hook would otherwise run on the B part in B and again on the total in W)."""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

_STORES: "weakref.WeakKeyDictionary[torch.nn.Module, DeferredWeightGrads]" = weakref.WeakKeyDictionary()


class DeferredWeightGrads:
    def __init__(self) -> None:
        self.collecting: Optional[list] = None  # (weight, flat input, flat output gradient) while B runs
        self.linear_backwards = 0  # Linear backward calls, for tests (one per use and micro-batch)

    @contextlib.contextmanager
    def collect(self, into: list) -> Iterator[None]:
        self.collecting = into
        try:
            yield
        finally:
            self.collecting = None


class _DeferrableLinear(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - torch's argument name
                bias: Optional[torch.Tensor], store: DeferredWeightGrads) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias, ctx.store = bias is not None, store
        ctx.param = weight  # the Parameter (a checkpoint's recomputation hands back another tensor object)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        input, weight = ctx.saved_tensors  # noqa: A001
        store = ctx.store
        store.linear_backwards += 1
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            flat_input = input.reshape(-1, input.shape[-1])
            if store.collecting is not None and not ctx.param._backward_hooks:
                store.collecting.append((ctx.param, flat_input, flat_grad))
            else:
                grad_weight = flat_grad.t().mm(flat_input)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_input, grad_weight, grad_bias, None


def _deferrable_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    store = _STORES.get(self)
    if store is None or not torch.is_grad_enabled() or not self.weight.requires_grad or \
            torch.is_autocast_enabled(input.device.type) or torch.compiler.is_compiling():
        return F.linear(input, self.weight, self.bias)
    return _DeferrableLinear.apply(input, self.weight, self.bias, store)


_deferrable_forward.__name__ = "forward"  # a pickled bound method is rebuilt as getattr(module, "forward")


def install(module: torch.nn.Module, store: DeferredWeightGrads) -> list[torch.nn.Linear]:
    """Every torch.nn.Linear of `module` with torch's own forward (or ZeRO's in-place one, which a pipeline's
    accumulating micro-batches rarely use) defers its weight gradient into `store` during a B pass."""
    from deepspeed_c.runtime.zero import bucket_linear

    changed = []
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear) or type(m).forward is not torch.nn.Linear.forward:
            continue
        bucket_linear.uninstall([m])
        if "forward" in m.__dict__:
            continue
        m.forward = types.MethodType(_deferrable_forward, m)
        _STORES[m] = store
        changed.append(m)
    return changed


def uninstall(modules: list[torch.nn.Linear]) -> None:
    for m in modules:
        if getattr(m.__dict__.get("forward"), "__func__", None) is _deferrable_forward:
            del m.__dict__["forward"]
        _STORES.pop(m, None)


def weight_totals(params: list[torch.nn.Parameter], computed: tuple, deferred: list) -> list[tuple[Any, Any]]:
    """(parameter, its gradient of one micro-batch) for every parameter that got one: what B computed plus
    the deferred Linear GEMMs."""
    totals: list[Optional[torch.Tensor]] = list(computed)
    index = {id(p): i for i, p in enumerate(params)}
    for weight, flat_input, flat_grad in deferred:
        i = index[id(weight)]
        gw = flat_grad.t().mm(flat_input)
        totals[i] = gw if totals[i] is None else totals[i] + gw
    return [(p, g) for p, g in zip(params, totals) if g is not None]
