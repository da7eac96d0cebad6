"""DeepSpeedCPUAdam: Adam/AdamW for host parameters on the C core (AVX-512/AVX2 + OpenMP)."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPUAdam(CPUOptimizerBase):
    MOMENTS = ("exp_avg", "exp_avg_sq")
    OP_BUILDER = "CPUAdamBuilder"
    optimizer_id = 0

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self.adam_w_mode = adamw_mode

    def _kernel(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]], step: int) -> None:
        beta1, beta2 = group["betas"]
        self.ds_opt_op.adam_step(params, grads, moments[0], moments[1], copies, float(group["lr"]), float(beta1),
                                 float(beta2), float(group["eps"]), float(group["weight_decay"]), step,
                                 int(bool(group.get("bias_correction", True))), int(bool(self.adam_w_mode)))


def cpu_adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                  exp_avg_sqs: Sequence[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float, step: int, bias_correction: bool = True, adamw_mode: bool = True,
                  copies: Optional[Sequence[torch.Tensor]] = None, simd: Optional[str] = None) -> None:
    """One Adam step over tensor lists in one pass: the ZeRO-Offload hot path. params are typically
    the fp32 master partition, grads may be bf16/fp16 (read directly, no up-cast buffer), states
    fp32 or bf16, and `copies` (bf16/fp16) receive the updated weights in the same pass."""
    from deepspeed_c.ops.op_builder import CPUAdamBuilder

    op = CPUAdamBuilder(simd=simd).load()
    op.adam_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                 None if copies is None else list(copies), float(lr), float(betas[0]), float(betas[1]), float(eps),
                 float(weight_decay), int(step), int(bool(bias_correction)), int(bool(adamw_mode)))
