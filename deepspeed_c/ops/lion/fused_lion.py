"""FusedLion: DeepSpeed's multi-tensor Lion for CUDA parameters, one launch per (dtype group,
step value). State: per-parameter 0-dim float32 `step` and float32 `exp_avg`."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed_c.ops import fused_optimizer_utils as fu

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


class FusedLion(torch.optim.Optimizer):
    """Implements Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")
    with multi-tensor CUDA kernels; DeepSpeed's signature and defaults."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self._op = _load_op()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        fu.zero_grads(self, self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
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
        for group in self.param_groups:
            params, states = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise NotImplementedError("FusedLion does not support sparse gradients")
                fu.check_param(p, p.grad, "FusedLion")
                state = self.state[p]
                if len(state) == 0:
                    fu.init_state(state, group, p, _MOMENTS)
                else:
                    fu.normalize_state(state, p, _MOMENTS)
                params.append(p)
                states.append(state)
            if not params:
                continue
            fu.advance_steps(states)  # Lion has no bias correction; the count is kept for checkpoints
            beta1, beta2 = group["betas"]
            for _, idx in fu.bucket(p.device for p in params).items():
                self._op.multi_tensor_lion(
                    [fu.contiguous_grad(params[i].grad) for i in idx], [params[i] for i in idx],
                    [states[i]["exp_avg"] for i in idx], None, float(group["lr"]), float(beta1), float(beta2),
                    float(group["weight_decay"]))
        return loss
