"""FusedAdam: DeepSpeed's multi-tensor Adam/AdamW for CUDA parameters. One kernel launch per
(dtype group, step value) updates every parameter; the math is DeepSpeed's FusedAdam, which in
AdamW mode equals torch.optim.AdamW. State is torch's format (per-parameter 0-dim float32 `step`,
float32 `exp_avg` and `exp_avg_sq`), so torch.optim.AdamW loads it and the reverse."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed_c.ops import fused_optimizer_utils as fu
from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step
from deepspeed_c.ops.fused_step_plan import PlanCache

_MOMENTS = ("exp_avg", "exp_avg_sq")
_op = None


def _load_op() -> Any:
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import FusedAdamBuilder

        _op = FusedAdamBuilder().load()
    return _op


def multi_tensor_adam(grads: list[torch.Tensor], params: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                      step: int, weight_decay: float = 0.0, adam_w_mode: bool = True,
                      bias_correction: bool = True, out_params: list[torch.Tensor] | None = None,
                      grad_scale: float = 1.0) -> None:
    """One Adam step over parallel lists of CUDA tensors, in place, on the current stream.
    out_params (optional) receives the fp16/bf16 copy of fp32 (master) params in the same pass;
    gradients are divided by grad_scale first."""
    _load_op().multi_tensor_adam(grads, params, exp_avgs, exp_avg_sqs, out_params, float(lr), float(betas[0]),
                                 float(betas[1]), float(eps), int(step), bool(adam_w_mode), bool(bias_correction),
                                 float(weight_decay), float(grad_scale))


class FusedAdam(torch.optim.Optimizer):
    """Implements Adam (adam_w_mode=False: L2 decay added to the gradient) and AdamW (default)
    with multi-tensor CUDA kernels; parameters in host memory are stepped by the C CPU Adam kernel
    (DeepSpeed's FusedAdam runs on its CPU accelerator too). Same signature and defaults as DeepSpeed's FusedAdam; AMSGrad
    is not supported."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self._plans = PlanCache()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        fu.zero_grads(self, self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._plans.clear()
        super().load_state_dict(state_dict)
        fu.restore_fp32_moments(self, state_dict, _MOMENTS)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        """Performs one optimization step. The other arguments are DeepSpeed's deprecated ones,
        kept only to raise as DeepSpeed does."""
        if any(x is not None for x in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated.  Simply initialize it identically to "
                               "torch.optim.Adam, and call step() with no arguments.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        w_mode = bool(self.adam_w_mode)
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            lr, b1, b2, eps = float(group["lr"]), float(beta1), float(beta2), float(group["eps"])
            bc, wd = bool(group.get("bias_correction", True)), float(group["weight_decay"])

            def launch(params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[list[torch.Tensor]],
                       step: int) -> None:
                if params[0].device.type == "cpu":  # as DeepSpeed's FusedAdam on its CPU accelerator
                    fu.launch_with_contiguous_retry(
                        lambda gl: cpu_adam_step(params, gl, moments[0], moments[1], lr=lr, betas=(b1, b2), eps=eps,
                                                 weight_decay=wd, step=step, bias_correction=bc, adamw_mode=w_mode),
                        grads)
                else:
                    fu.check_cuda(params[0], "FusedAdam")
                    fu.launch_with_contiguous_retry(
                        lambda gl: _load_op().multi_tensor_adam(gl, params, moments[0], moments[1], None, lr, b1, b2,
                                                                eps, step, w_mode, bc, wd, 1.0), grads)

            self._plans.step(self, index, group, _MOMENTS, "FusedAdam", launch, require_cuda=False)
        return loss
