"""Gradient-accumulation scaling for backwards that do not go through `engine.backward`.

`engine.backward(loss)` divides exactly the loss it is given by gradient_accumulation_steps (as
DeepSpeed does). A direct `loss.backward()` or `tensor.backward(g)` (DeepSpeed >= 0.18.3 accepts
them) has no loss to divide, so the division is applied where every gradient of that backward
arrives exactly once, whatever the model returned and however the user combined its outputs: at
the trainable parameters, by a hook on each that runs before the gradient is accumulated into
`.grad`. (Dividing at the model's outputs instead scales some paths twice and others never when
one output is computed from another, e.g. a loss from the logits beside the logits.) Since the
scaling is linear, both routes give the gradients of loss / gradient_accumulation_steps.

A leaf's tensor hook also runs on a gradient `autograd.grad` captures for the user (GradNorm, MAML): such a
gradient is returned, never accumulated, so it is left as autograd computed it. The hook scales only in a
backward that executes the parameter's AccumulateGrad (runtime/autograd_paths.py); the division is
differentiable, so create_graph does not change that."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from deepspeed_c.runtime import autograd_paths


class DirectBackwardScaler:
    """Per-parameter pre-accumulation hooks that divide by `gas()` while `active()` says so."""

    def __init__(self, params: Sequence[torch.nn.Parameter], gas: Callable[[], int],
                 active: Callable[[], bool], reducer: Any = None) -> None:
        self._gas = gas
        self._active = active
        self._hooks: set[Any] = set()
        self._handles = [p.register_hook(self._hook_for(p)) for p in params if p.requires_grad]
        if reducer is not None:
            # a ZeRO-1/2 partitioner may let a Linear write a weight gradient straight into its bucket
            # (runtime/zero/bucket_linear.py), skipping these hooks: only while they would not scale
            reducer.register_inert_hook_test(self.is_inert)

    def is_inert(self, hook: Any) -> bool:
        """`hook` is this scaler's and leaves gradients as they are right now."""
        return hook in self._hooks and (not self._active() or self._gas() == 1)

    def _hook_for(self, param: torch.nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        ref = weakref.ref(param)  # the hook lives on the parameter: no cycle through it

        def scale(grad: torch.Tensor) -> torch.Tensor:
            if not self._active():
                return grad
            gas = self._gas()
            p = ref()
            if gas == 1 or p is None or not autograd_paths.param_accumulates(p):
                return grad
            return grad / gas

        self._hooks.add(scale)
        return scale

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooks.clear()
