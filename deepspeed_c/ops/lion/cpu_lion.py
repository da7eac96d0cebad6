"""DeepSpeedCPULion: Lion for host parameters on the C core."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPULion(CPUOptimizerBase):
    """Lion (Chen et al. 2023) for parameters in host memory, stepped by a C kernel in one pass
    over memory: p = p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g), then
    m = beta2 * m + (1 - beta2) * g. State dict: `step`, `exp_avg`; fp16_param_groups and dtypes as
    DeepSpeedCPUAdam."""

    MOMENTS = ("exp_avg",)
    OP_BUILDER = "CPULionBuilder"
    optimizer_id = 0

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.opt_id = DeepSpeedCPULion.optimizer_id
        DeepSpeedCPULion.optimizer_id += 1

    def _kernel(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]], step: int) -> None:
        beta1, beta2 = group["betas"]
        self.ds_opt_op.lion_step(params, grads, moments[0], copies, float(group["lr"]), float(beta1), float(beta2),
                                 float(group["weight_decay"]))
