"""`deepspeed.runtime.bf16_optimizer.BF16_Optimizer`: isinstance of the engine's optimizer where DeepSpeed
builds this class, bf16 with fp32 gradient accumulation (see runtime/optimizer_roles.py)."""
from __future__ import annotations

from deepspeed_c.runtime.optimizer_roles import OptimizerRole

__all__ = ["BF16_Optimizer"]


class BF16_Optimizer(metaclass=OptimizerRole):
    """bf16 parameters, fp32 gradient accumulation and masters."""
