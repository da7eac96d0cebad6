"""`deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer`: isinstance of the engine's stage-0 optimizer where
DeepSpeed builds this class (see runtime/optimizer_roles.py)."""
from __future__ import annotations

from deepspeed_c.runtime.optimizer_roles import OptimizerRole

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(metaclass=OptimizerRole):
    """Stage 0, fp16 or bf16 without fp32 accumulation, around DeepSpeed's FusedAdam."""
