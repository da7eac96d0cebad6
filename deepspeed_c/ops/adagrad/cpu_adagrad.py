"""DeepSpeedCPUAdagrad: Adagrad for host parameters on the C core."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPUAdagrad(CPUOptimizerBase):
    """Adagrad (torch.optim.Adagrad's rule, lr_decay 0, initial accumulator 0) for parameters in
    host memory, stepped by a C kernel in one pass over memory. State dict as torch's (`step`,
    `sum`); fp16_param_groups and dtypes as DeepSpeedCPUAdam. amsgrad is not supported."""

    MOMENTS = ("sum",)  # torch.optim.Adagrad's state key
    OP_BUILDER = "CPUAdagradBuilder"
    optimizer_id = 0

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.opt_id = DeepSpeedCPUAdagrad.optimizer_id
        DeepSpeedCPUAdagrad.optimizer_id += 1

    def _kernel(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]], step: int) -> None:
        self.ds_opt_op.adagrad_step(params, grads, moments[0], copies, float(group["lr"]), float(group["eps"]),
                                    float(group["weight_decay"]))
