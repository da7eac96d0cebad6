"""Lamb on the CPU, in torch: the same update as FusedLamb (DeepSpeed's Lamb), for models that
live on the CPU where the CUDA kernel cannot run.

Per tensor, with g the (unscaled) gradient:
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
    u = m / (sqrt(v) + eps) + weight_decay * p         (eps_inside_sqrt: m / sqrt(v + eps))
    trust = clamp(|p| / |u|, min_coeff, max_coeff)      (1 when either norm is 0)
    p -= step_size * trust * u,   step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)  (lr without bias_correction)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch


class CPULamb(torch.optim.Optimizer):

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("Lamb does not support the AMSGrad variant.")
        if max_grad_norm:
            raise ValueError("max_grad_norm is not supported by CPULamb; use the engine's gradient_clipping")
        if lr < 0 or eps < 0 or not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid Lamb hyper-parameters: lr={lr}, eps={eps}, betas={betas}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.lamb_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                w = p.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v + group["eps"]).sqrt_() if self.eps_mode == 0 else v.sqrt().add_(group["eps"])
                update = m / denom
                if group["weight_decay"] != 0:
                    update.add_(w, alpha=group["weight_decay"])
                w_norm = float(w.norm())
                u_norm = float(update.norm())
                coeff = 1.0
                if w_norm != 0 and u_norm != 0:
                    coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                if group["bias_correction"]:
                    step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
                else:
                    step_size = group["lr"]
                w.add_(update, alpha=-step_size * coeff)
                if w is not p:
                    p.copy_(w)
                self.lamb_coeffs.append(coeff)
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)
