"""The mixed-precision optimizer step's decision sequence, once for every optimizer that owns one
(the plain mixed-precision optimizer and ZeRO 1/2): overflow check (agreed across ranks) -> loss
scale update -> skip, or unscale + clip + step.

The gradient norm arrives either as a host float (the separate-pass step) or as a device tensor
(the fused epilogue, which unscales, clips and skips on the device): then the host reads it only
when an overflow check needs the decision (fp16), so a bf16 step never waits for the device."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from deepspeed_c.runtime.grad_norm import clip_coefficient

Norm = Union[float, torch.Tensor]


@dataclass
class StepOutcome:
    skipped: bool
    grad_norm: Optional[Norm]  # the unscaled global norm (a device scalar after a fused step)


def overflow_checked_step(norm: Norm, *, check_overflow: bool, sync_overflow: Optional[Callable[[bool], bool]],
                          loss_scaler: Any, grad_scale: Callable[[], float], clip_grad: float,
                          apply_coef: Optional[Callable[[float], None]] = None,
                          apply_fused: Optional[Callable[[torch.Tensor, float], None]] = None) -> StepOutcome:
    """norm: global L2 norm of the scaled gradients. apply_coef(coef) multiplies the gradients by coef
    (unscale and clip) and steps; apply_fused(norm, loss_scale) does both on the device."""
    overflow = False
    if check_overflow:
        overflow = not math.isfinite(float(norm))
        if sync_overflow is not None:
            overflow = sync_overflow(overflow)
    if loss_scaler is not None:
        loss_scaler.update_scale(overflow)
    if overflow:
        return StepOutcome(True, None)
    scale = grad_scale()  # the scale the gradients were made with (update_scale may have grown it)
    if isinstance(norm, torch.Tensor):
        assert apply_fused is not None
        apply_fused(norm, scale)
        return StepOutcome(False, norm.reshape(-1)[0] / scale)
    assert apply_coef is not None
    unscaled = norm / scale
    coef = 1.0 / scale
    if clip_grad > 0.0 and math.isfinite(norm):
        coef *= clip_coefficient(unscaled, clip_grad)
    apply_coef(coef)
    return StepOutcome(False, unscaled)
