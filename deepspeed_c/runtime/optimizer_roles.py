"""DeepSpeed's engine-built optimizer classes as names a script can import and test with isinstance.

DeepSpeed's engine wraps the client optimizer in one of FP16_Optimizer (stage 0, fp16 or bf16, with its
FusedAdam), FP16_UnfusedOptimizer (stage 0, any other optimizer) or BF16_Optimizer (bf16 with fp32 gradient
accumulation); scripts import those classes to test `engine.optimizer` (then reach `.optimizer`, the basic
one). deepspeed_c has one stage-0 mixed-precision optimizer for the three roles; it records which of the three
DeepSpeed would have built (`deepspeed_role`), and these classes answer isinstance from that record. They are
built by `deepspeed.initialize` only: constructing one directly is refused with the way to get one."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerRole", "deepspeed_role"]


class OptimizerRole(type):
    """Metaclass: `isinstance(obj, Cls)` is true when obj's recorded DeepSpeed class is Cls's name."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or getattr(obj, "deepspeed_role", None) == cls.__name__

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__name__} is built by deepspeed.initialize (engine.optimizer is one when DeepSpeed "
                        f"would build it); pass the basic optimizer to initialize instead")


def deepspeed_role(basic: torch.optim.Optimizer, low_precision_dtype: torch.dtype,
                   grad_accum_dtype: torch.dtype) -> str:
    """The class DeepSpeed 0.19.8's engine wraps a stage-0 16-bit run's optimizer in: BF16_Optimizer when bf16
    gradients accumulate in fp32, else FP16_Optimizer around its FusedAdam and FP16_UnfusedOptimizer around
    anything else."""
    if low_precision_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32:
        return "BF16_Optimizer"
    from deepspeed_c.ops.adam.fused_adam import FusedAdam

    return "FP16_Optimizer" if isinstance(basic, FusedAdam) else "FP16_UnfusedOptimizer"
