"""Loss scaling for fp16 training, with DeepSpeed's semantics.

DynamicLossScaler: start at init_scale; an overflow skips the step and, once `delayed_shift`
(the config's `hysteresis`) overflows have used up the hysteresis, divides the scale by 2 (never
below min_scale); `scale_window` clean steps since the last overflow double it. With
`consecutive_hysteresis` every clean step refills the hysteresis."""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from deepspeed_c.runtime.config.precision import (CONSECUTIVE_HYSTERESIS, DELAYED_SHIFT, INITIAL_LOSS_SCALE,
                                                  MIN_LOSS_SCALE, SCALE_WINDOW)
from deepspeed_c.utils.logging import logger

__all__ = ["LossScalerBase", "LossScaler", "DynamicLossScaler", "CreateLossScaler", "INITIAL_LOSS_SCALE",
           "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE", "to_python_float"]


def to_python_float(t: Any) -> float:
    return t.item() if hasattr(t, "item") else t[0]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# what a checkpoint restores of a scaler; the rest (window, minimum, factor) comes from the config
_RESTORED = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _as_state(state: Any) -> dict[str, Any]:
    """A scaler state dict from a dict or from a loss-scaler object as DeepSpeed pickles it into ZeRO
    checkpoints (any object with the attributes: DeepSpeed's class or deepspeed_c's stand-in)."""
    if isinstance(state, dict):
        return state
    return {k: v for k, v in vars(state).items() if k in _RESTORED}


class LossScalerBase:
    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        return tuple(self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        pass

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: Any) -> None:
        self.cur_scale = _as_state(state)["cur_scale"]


class LossScaler(LossScalerBase):
    """A static loss scale."""

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True,
                 dtype: torch.dtype = torch.half) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not math.isfinite(float(x.float().sum()))

    def update_scale(self, overflow: bool) -> None:
        rank = _rank()
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise Exception(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                if rank == 0:
                    msg = f"[deepspeed] OVERFLOW! Rank {rank} Skipping step."
                    if self.dtype == torch.half:
                        msg += f" Attempted loss scale: {int(self.cur_scale)}, reducing to {int(next_scale)}"
                    logger.info(msg)
                self.cur_scale = next_scale
            else:
                if rank == 0:
                    msg = f"[deepspeed] OVERFLOW! Rank {rank} Skipping step."
                    if self.dtype == torch.half:
                        msg += (f" Attempted loss scale: {int(self.cur_scale)}, but hysteresis is "
                                f"{self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}")
                    logger.info(msg)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: Any) -> None:
        for key, value in _as_state(state).items():
            setattr(self, key, value)


def CreateLossScaler(dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool,
                     dynamic_loss_args: dict[str, Any] | None) -> LossScalerBase:
    """A dynamic scaler for fp16 with dynamic scaling, else a static one (1.0 unless fp16)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("Dynamic loss scaling parameters must be defined.")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
