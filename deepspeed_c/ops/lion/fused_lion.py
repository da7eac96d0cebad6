"""FusedLion: DeepSpeed's multi-tensor Lion for CUDA parameters, one launch per (dtype group,
step value). State: per-parameter 0-dim float32 `step` and float32 `exp_avg`."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import functools

import torch

from deepspeed_c.ops import fused_optimizer_utils as fu
from deepspeed_c.ops.fused_step_plan import PlanCache

_MOMENTS = ("exp_avg",)
_op = None


def _load_op() -> Any:
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import FusedLionBuilder

        _op = FusedLionBuilder().load()
    return _op


def multi_tensor_lion(grads: list[torch.Tensor], params: list[torch.Tensor], exp_avgs: list[torch.Tensor], *,
                      lr: float, betas: tuple[float, float], weight_decay: float = 0.0,
                      out_params: list[torch.Tensor] | None = None) -> None:
    """One Lion step over parallel lists of CUDA tensors, in place, on the current stream."""
    _load_op().multi_tensor_lion(grads, params, exp_avgs, out_params, float(lr), float(betas[0]),
                                 float(betas[1]), float(weight_decay))


@functools.lru_cache(maxsize=None)
def _cpu_op() -> Any:
    from deepspeed_c.ops.op_builder import CPULionBuilder

    return CPULionBuilder().load()


class FusedLion(torch.optim.Optimizer):
    """Implements Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")
    with multi-tensor CUDA kernels; DeepSpeed's signature and defaults."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults)
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
        """Performs one optimization step (the other arguments are DeepSpeed's deprecated ones)."""
        if any(x is not None for x in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedLion has been updated.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]))

            # Lion has no bias correction; the step count is kept for checkpoints
            def launch(params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[list[torch.Tensor]],
                       step: int) -> None:
                if params[0].device.type == "cpu":  # the C CPU Lion kernel, as DeepSpeed on CPU
                    fu.launch_with_contiguous_retry(
                        lambda gl: _cpu_op().lion_step(params, gl, moments[0], None, *hyper), grads)
                else:
                    fu.check_cuda(params[0], "FusedLion")
                    fu.launch_with_contiguous_retry(
                        lambda gl: _load_op().multi_tensor_lion(gl, params, moments[0], None, *hyper), grads)

            self._plans.step(self, index, group, _MOMENTS, "FusedLion", launch, sparse_error=NotImplementedError,
                             require_cuda=False)
        return loss
