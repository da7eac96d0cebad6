"""1-bit Adam (Tang et al. 2021, https://arxiv.org/abs/2102.02888), DeepSpeed's OnebitAdam.

Semantics (DeepSpeed 0.19.6's, the last release that shipped it):
  * the first step() only creates the state (exp_avg, exp_avg_sq at zero, step = 1): no update;
  * warm-up (step < freeze_step): the engine all-reduces gradients as usual;
    m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, update = m / (sqrt(v) + eps) with no bias
    correction (`bias_correction` is accepted and unused), plus weight_decay * p, p -= lr * update;
  * from the step after the one whose counter reaches freeze_step, the variance is frozen and the
    engine stops all-reducing gradients: m = b1 m + (1-b1) g_local, then m is replaced by its
    compressed average over the ranks (signs + one scale per tensor, worker and server error
    feedback: runtime/comm/compressed.py), masked by the group's exp_avg_mask, and the update uses
    the frozen v. Param groups with `non_freeze: True` keep exact Adam (all-reduced gradients).
With one rank nothing is compressed (DeepSpeed's size check)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed_c.runtime.fp16.onebit.base import OnebitOptimizer


class OnebitAdam(OnebitOptimizer):
    """Implements the 1-bit Adam algorithm (DeepSpeed's arguments and defaults; see module docstring).

    deepspeed: the engine, whose gradient all-reduce this optimizer switches off once it compresses.
    cuda_aware: for DeepSpeed's MPI backend; accepted. comm_backend_name: "nccl" (default) or
    "compressed" (torch.distributed collectives with the C/CUDA sign codec), "mpi" (needs mpi4py)."""

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0., max_grad_norm: float = 0.,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        if amsgrad:
            raise RuntimeError("1-bit Adam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1  # DeepSpeed keeps it and never reads it
        self.freeze_step = freeze_step
        self.adam_freeze_key = False
        self.initialize = False
        self._setup_comm(deepspeed, comm_backend_name, cuda_aware)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = list(self.with_grads(self.param_groups, grads, "1-bit Adam"))
        for _, p, _ in work:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
        if not self.initialize:
            # DeepSpeed's first step sets up its buffers (and exchanges the zero momenta once, which
            # changes nothing): no parameter moves
            self.initialize = True
            return loss

        compressed: list[tuple[dict, torch.Tensor]] = []
        for group, p, g in work:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if not self.adam_freeze_key:
                exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            elif group.get("non_freeze") is True:
                g = self._all_reduce_mean(g)
                exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            else:
                exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
                compressed.append((group, p))
        if compressed:
            self.compressed_average_("exp_avg", [self.state[p]["exp_avg"] for _, p in compressed])
            for group, p in compressed:
                self.apply_mask_(group, self.state[p]["exp_avg"])
        for group, p, _ in work:
            self.apply_adam_update_(group, p, self.state[p], self.adam_freeze_key)

        if not self.adam_freeze_key and work and self.state[work[-1][1]]["step"] >= self.freeze_step:
            self.adam_freeze_key = True
            self.set_engine_allreduce(False)
        return loss

    def _all_reduce_mean(self, g: torch.Tensor) -> torch.Tensor:
        if self.size <= 1:
            return g
        import deepspeed_c.comm as dist
        from deepspeed_c.runtime.fp16.onebit.base import data_parallel_world

        group, _ = data_parallel_world(self.deepspeed)
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g.mul_(1.0 / self.size)

    def load_state_dict(self, state_dict: dict) -> None:
        """Moments and step counters as saved; the phase follows the loaded step (warm-up, with the
        engine's all-reduce on, or compression, with it off); error buffers restart at zero until the
        checkpoint's rank files restore this rank's own (load_rank_checkpoint_file)."""
        super().load_state_dict(self._prepare_state_dict(state_dict))
        frozen = self.first_state().get("step", 0) >= self.freeze_step
        self.adam_freeze_key = frozen
        self.set_engine_allreduce(not frozen)
        # a loaded state needs no set-up step (DeepSpeed's fresh optimizer would skip one update)
        self.initialize = self.first_state().get("step", 0) > 0
        self.reset_compression_errors()
