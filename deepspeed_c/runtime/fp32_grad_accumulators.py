"""fp32 gradient accumulators for a 16-bit model at stage 0 (DeepSpeed's BF16_Optimizer with
data_types.grad_accum_dtype "fp32").

Every micro-step's 16-bit gradient is folded into an fp32 buffer of its parameter as soon as autograd
has accumulated it, and the 16-bit gradient is freed. The same object is the stage-0 reducer's
gradient source and sink (`read` / `write`): it reduces the fp32 accumulators, not the 16-bit
param.grad, and writes the averaged sums back into them, as DeepSpeed's engine all-reduces the grads
its BF16_Optimizer hands it for reduction (cast to communication_data_type on the wire)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch


class Fp32AccumulatorSlots:
    """One fp32 buffer per parameter (allocated at its first gradient, shaped and laid out like its
    `like` tensor: the parameter's fp32 master), owned here; `hook=True` folds each fresh gradient in
    from autograd's post-accumulate hook."""

    def __init__(self, params: Sequence[torch.nn.Parameter], like: Sequence[torch.Tensor], hook: bool) -> None:
        self.params = list(params)
        self.like = list(like)
        self.index = {id(p): k for k, p in enumerate(self.params)}
        self.buffers: list[Optional[torch.Tensor]] = [None] * len(self.params)
        self._hooks: list[Any] = []
        if hook:
            for k, p in enumerate(self.params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._fold_hook(k)))

    def _fold_hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def fold(p: torch.Tensor) -> None:
            self.fold(k)
        return fold

    @torch.no_grad()
    def fold(self, k: int) -> None:
        """Adds parameter k's fresh 16-bit gradient into its fp32 accumulator and frees it (a no-op
        when the hook already did)."""
        p = self.params[k]
        if p.grad is None:
            return
        buf = self.buffers[k]
        if buf is None:
            buf = self.buffers[k] = torch.zeros_like(self.like[k])
        buf.add_(p.grad.detach().view_as(buf))
        p.grad = None

    def folded(self, k: int) -> Optional[torch.Tensor]:
        """Parameter k's accumulated fp32 gradient, with any gradient still on the parameter (one set
        outside backward, e.g. zeros for an unused parameter) folded in first."""
        self.fold(k)
        return self.buffers[k]

    def zero_(self) -> None:
        for buf in self.buffers:
            if buf is not None:
                buf.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the reducer's slot face ------------------------------------------------------------------
    def read(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return self.folded(self.index[id(param)])

    @torch.no_grad()
    def write(self, param: torch.nn.Parameter, reduced: torch.Tensor) -> None:
        k = self.index[id(param)]
        buf = self.buffers[k]
        if buf is None:
            self.buffers[k] = reduced.detach().to(torch.float32).view(param.shape).clone()
        else:
            buf.copy_(reduced.view_as(buf))
