"""`deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer`: isinstance of the engine's stage-0
optimizer where DeepSpeed builds this class (see runtime/optimizer_roles.py)."""
from __future__ import annotations

from deepspeed_c.runtime.optimizer_roles import OptimizerRole

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(metaclass=OptimizerRole):
    """Stage 0, fp16 or bf16 without fp32 accumulation, around any optimizer but FusedAdam."""
