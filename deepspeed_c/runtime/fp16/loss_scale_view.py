"""DeepSpeed 0.19.8's `optimizer.loss_scale_config` (its LossScaleConfig's fields) read live from a stage-0
mixed-precision optimizer's loss scaler, for scripts that read the scale through it."""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["LossScaleView"]


class LossScaleView:
    """use_grad_scaling (fp16 only), dynamic_loss_scale, cur_iter, cur_scale; with dynamic scaling also
    last_overflow_iter, scale_factor, scale_window and min_loss_scale (None otherwise, as DeepSpeed's)."""

    def __init__(self, optimizer: Any) -> None:
        self._opt = optimizer

    @property
    def use_grad_scaling(self) -> bool:
        return self._opt.low_precision_dtype == torch.float16

    @property
    def dynamic_loss_scale(self) -> bool:
        return bool(self._opt.dynamic_loss_scale)

    @property
    def cur_iter(self) -> int:
        return self._opt.cur_iter

    @property
    def cur_scale(self) -> float:
        scaler = self._opt.loss_scaler
        return float(scaler.cur_scale) if scaler is not None else 1.0

    def _dynamic(self, name: str) -> Optional[Any]:
        return getattr(self._opt.loss_scaler, name, None) if self.dynamic_loss_scale else None

    @property
    def last_overflow_iter(self) -> Optional[int]:
        return self._dynamic("last_overflow_iter")

    @property
    def scale_factor(self) -> Optional[float]:
        return self._dynamic("scale_factor")

    @property
    def scale_window(self) -> Optional[int]:
        return self._dynamic("scale_window")

    @property
    def min_loss_scale(self) -> Optional[float]:
        return self._dynamic("min_scale")
