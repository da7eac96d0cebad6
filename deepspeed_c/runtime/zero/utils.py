"""deepspeed.runtime.zero.utils's public names: the exception ZeRO's setup raises, the supported-optimizer
check and the partitioned-parameter test. User code imports ZeRORuntimeException from here to catch it."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.zero.optimizer_inputs import ZERO_SUPPORTED_OPTIMIZERS, is_zero_supported_optimizer

__all__ = ["ZeRORuntimeException", "ZERO_SUPPORTED_OPTIMIZERS", "is_zero_supported_optimizer", "is_zero_param"]


class ZeRORuntimeException(RuntimeError):
    """A ZeRO configuration the runtime refuses (ZeRO-Offload with a client optimizer that is not a host
    optimizer while zero_force_ds_cpu_optimizer is on). DeepSpeed derives it from Exception; RuntimeError
    here, so `except RuntimeError` written against earlier deepspeed_c releases still catches it."""


def is_zero_param(parameter: Any) -> bool:
    """Whether `parameter` is a ZeRO-3 partitioned parameter (zero.Init or the stage-3 engine gave it a ds_id)."""
    import torch

    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")
