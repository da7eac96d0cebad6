"""DeepSpeedCPUAdagrad: Adagrad for host parameters on the C core."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPUAdagrad(CPUOptimizerBase):
    """Adagrad (torch.optim.Adagrad's rule, lr_decay 0, initial accumulator 0) for parameters in
    host memory, stepped by a C kernel in one pass over memory. State dict as torch's (`step`,
    `sum`); fp16_param_groups and dtypes as DeepSpeedCPUAdam. amsgrad is not supported.

    Sparse gradients (nn.Embedding(sparse=True)) are stepped as DeepSpeed's are: only the rows the
    gradient touches, through the same kernel on the gathered rows of the parameter and of `sum`."""

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

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None,
             fp16_param_groups: Optional[Sequence[Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.grad is not None and p.grad.is_sparse:
                        self._sparse_step(group, p, f"params[{gi}][{pi}]")
                        if fp16_param_groups is not None:
                            _copy_of(fp16_param_groups, gi, pi).copy_(p)
                        hidden.append((p, p.grad))
                        p.grad = None  # the dense pass below skips it
            super().step(None, fp16_param_groups)
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss

    def _sparse_step(self, group: dict[str, Any], p: torch.Tensor, name: str) -> None:
        grad = p.grad.coalesce()  # an embedding's gradient repeats rows: sum them first
        dense = p.grad
        p.grad = None
        try:
            self._check(p, name)
        finally:
            p.grad = dense
        state = self._prepare_state(group, p)
        if state["sum"].dtype != p.dtype:
            raise TypeError(f"{name}: sparse gradients need the optimizer state in the parameter's dtype "
                            f"({p.dtype}), found {state['sum'].dtype}")
        state["step"] += 1
        index = tuple(grad.indices())
        rows = p[index].contiguous()
        sums = state["sum"][index].contiguous()
        values = grad.values().to(p.dtype).contiguous()
        self._kernel(group, [rows], [values], [[sums]], None, int(state["step"]))
        p.index_put_(index, rows)
        state["sum"].index_put_(index, sums)


def _copy_of(fp16_param_groups: Sequence[Any], gi: int, pi: int) -> torch.Tensor:
    group = fp16_param_groups[gi]
    return group[pi] if isinstance(group, (list, tuple)) else group
