"""Backward hooks on a forward's outputs: they see backward begin (for `loss.backward()` as well
as `engine.backward(loss)`) and divide the incoming gradient by the accumulation steps.

Only root outputs are scaled: when the outputs include scalar tensors (the losses a model returns,
as Hugging Face models do next to their logits), only those are hooked, so a gradient that flows
from the loss into the logits is not divided twice."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def _tensors(outputs: Any, found: list[torch.Tensor], depth: int = 0) -> None:
    if depth > 8:
        return
    if isinstance(outputs, torch.Tensor):
        if outputs.grad_fn is not None and outputs.is_floating_point():
            found.append(outputs)
    elif isinstance(outputs, (tuple, list)):
        for item in outputs:
            _tensors(item, found, depth + 1)
    elif isinstance(outputs, dict):
        for item in outputs.values():
            _tensors(item, found, depth + 1)
    elif dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        for field in dataclasses.fields(outputs):
            _tensors(getattr(outputs, field.name), found, depth + 1)


def register_output_hooks(outputs: Any, hook: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Registers hook on the root output tensors; returns how many were hooked."""
    if not torch.is_grad_enabled():
        return 0
    found: list[torch.Tensor] = []
    _tensors(outputs, found)
    scalars = [t for t in found if t.numel() == 1]
    roots = scalars if scalars else found
    seen: set[int] = set()
    for t in roots:
        if id(t) not in seen:
            seen.add(id(t))
            t.register_hook(hook)
    return len(seen)


def is_loss_for_backward(value: Any) -> bool:
    """A one-element tensor that came out of autograd (what engine.backward accepts)."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.grad_fn is not None
