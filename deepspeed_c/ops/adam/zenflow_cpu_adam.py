"""ZenFlowCPUAdam (DeepSpeed's deepspeed.ops.adam.ZenFlowCPUAdam): the C CPU Adam whose step takes the step
count from its caller. ZenFlow steps the host master only every few training steps, from a gradient
accumulated over them, and numbers that host step itself: `step(step_id)` sets every stepped parameter's
count to step_id (bias correction uses it) instead of adding one. With overlap_step=True the host step is
driven elsewhere (the ZenFlow optimizer's background step) and `step` is DeepSpeedCPUAdam's own."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed_c.ops.adam.cpu_adam import DeepSpeedCPUAdam


class ZenFlowCPUAdam(DeepSpeedCPUAdam):

    def __init__(self, *args: Any, overlap_step: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_step = overlap_step
        if not overlap_step:
            self.step = self._sequential_step  # type: ignore[method-assign]  (DeepSpeed binds it per instance)

    @torch.no_grad()
    def _sequential_step(self, step_id: int, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam step of every host parameter with a gradient, at step count `step_id`."""
        if isinstance(step_id, bool) or not isinstance(step_id, int) or step_id < 1:
            raise ValueError(f"ZenFlowCPUAdam.step: step_id must be a positive int (the host step's count), "
                             f"got {step_id!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            idx = [pi for pi, p in enumerate(group["params"]) if p.grad is not None]
            if not idx:
                continue
            params = [group["params"][pi] for pi in idx]
            states = [self._ready_state(group, p, f"params[{gi}][{pi}]") for pi, p in zip(idx, params)]
            for st in states:
                st["step"].fill_(float(step_id))
            grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params]
            self.step_tensors(group, [p.detach() for p in params], grads,
                              [[st[k] for st in states] for k in self.MOMENTS], None, step_id)
        return loss
