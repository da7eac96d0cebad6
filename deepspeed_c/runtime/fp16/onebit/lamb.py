"""1-bit LAMB (Li et al. 2021, https://arxiv.org/abs/2104.06069), DeepSpeed's OnebitLamb.

Semantics (DeepSpeed 0.19.6's), after a first step() that only creates the state:
  * warm-up (engine all-reduces gradients): Adam moments without bias correction,
    update = m / (sqrt(v) + eps) (+ weight_decay * p), LAMB coefficient ||p|| / ||update|| clipped
    to [min_coeff, max_coeff] (1 when either norm is 0); every coefficient other than 1 enters the
    moving average lamb_coeff_freeze (coeff_beta). At step == freeze_step, v_fresh = v.
  * compression (after freeze_step; the engine stops all-reducing): on the first compressed step
    each tensor gets scaling_coeff = (mean over tensors of rms(m)) / rms(m) so momenta of very
    different magnitudes share one scale; m = (b1 m + (1-b1) g_local) * scaling_coeff, all momenta
    flattened into ONE buffer (padded, the padding kept between steps) and exchanged compressed,
    then divided back. The gradient is reconstructed from the momentum, g = (m - b1 m_prev)/(1-b1),
    and feeds v_fresh; the frozen v gives the update. The coefficient is lamb_coeff_freeze * factor,
    factor = max(denominator(v) / denominator(v_fresh)) (blended by ||update without decay|| /
    ||update|| when weight_decay > 0), clipped to [factor_min, factor_max] and to within
    factor_threshold of the previous step's factor.
get_lamb_coeffs() returns the last step's coefficients. With one rank nothing is exchanged."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed_c.runtime.fp16.onebit.base import OnebitOptimizer


def _rms(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) / max(t.numel(), 1) ** 0.5


class OnebitLamb(OnebitOptimizer):
    """Implements the 1-bit LAMB algorithm (DeepSpeed's arguments and defaults; see module docstring)."""

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0., max_grad_norm: float = 0.,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        if amsgrad:
            raise RuntimeError("1-bit Lamb does not support the AMSGrad variant.")
        params = _drop_empty(params)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.lamb_freeze_key = False
        self.initialize = False
        self.lamb_coeffs: list[float] = []
        self._setup_comm(deepspeed, comm_backend_name, cuda_aware)

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state.update(step=0, lamb_coeff_freeze=0.0, last_factor=1.0,
                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                         exp_avg_sq_fresh=torch.zeros_like(p, memory_format=torch.preserve_format))
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        work = list(self.with_grads(self.param_groups, grads, "1-bit Lamb"))
        for _, p, _ in work:
            self._init_state(p)["step"] += 1
        if not self.initialize:
            self.initialize = True  # the set-up step: no update (see OnebitAdam)
            return loss
        if self.lamb_freeze_key:
            self._compressed_step(work)
        else:
            self._warmup_step(work)
            if work and self.state[work[-1][1]]["step"] >= self.freeze_step:
                self.lamb_freeze_key = True
                self.set_engine_allreduce(False)
        return loss

    def _warmup_step(self, work: list) -> None:
        for group, p, g in work:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if state["step"] == self.freeze_step:
                state["exp_avg_sq_fresh"] = exp_avg_sq.detach().clone()
            weight_norm = float(p.detach().float().norm())
            update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p.detach(), alpha=group["weight_decay"])
            update_norm = float(update.norm())
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                beta = self.coeff_beta
                state["lamb_coeff_freeze"] = beta * state["lamb_coeff_freeze"] + (1 - beta) * coeff
            self.lamb_coeffs.append(coeff)
            p.add_(update.to(p.dtype), alpha=-group["lr"] * coeff)

    def _compressed_step(self, work: list) -> None:
        stepped = [p for g in self.param_groups for p in g["params"] if "exp_avg" in self.state.get(p, {})]
        if any("scaling_coeff" not in self.state[p] for p in stepped):
            scales = [_rms(self.state[p]["exp_avg"]) for p in stepped]
            united = sum(scales) / len(scales)
            for p, scale in zip(stepped, scales):
                self.state[p]["scaling_coeff"] = united / scale
        last = {id(p): self.state[p]["exp_avg"].clone() for _, p, _ in work}
        for group, p, g in work:
            state = self.state[p]
            beta1 = group["betas"][0]
            state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1).mul_(state["scaling_coeff"])
        if self.size > 1:
            # every momentum, in parameter order, as one flat buffer with one scale (DeepSpeed's exp_avg_flat)
            momenta = [self.state[p]["exp_avg"] for p in stepped]
            flat = torch.cat([m.reshape(-1).float() for m in momenta])
            self.compressed_average_("exp_avg_flat", [flat], persistent_pad=True)
            offset = 0
            for m in momenta:
                m.copy_(flat[offset:offset + m.numel()].view_as(m))
                offset += m.numel()
        for group, p, _ in work:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
            exp_avg.div_(state["scaling_coeff"])
            self.apply_mask_(group, exp_avg)
            grad = (exp_avg - last[id(p)] * beta1) / (1 - beta1)
            fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = exp_avg_sq.sqrt() + group["eps"]
            prelim = exp_avg / denom
            update = prelim + group["weight_decay"] * p.detach() if group["weight_decay"] > 0.0 else prelim
            factor = float((denom / (fresh.sqrt() + group["eps"])).max())
            if group["weight_decay"] > 0.0:
                ratio = min(1.0, float(prelim.norm()) / float(update.norm()))
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(max(factor, state["last_factor"] * (1.0 - self.factor_threshold)),
                         state["last_factor"] * (1.0 + self.factor_threshold))
            state["last_factor"] = factor
            coeff = state["lamb_coeff_freeze"] * factor
            self.lamb_coeffs.append(coeff)
            p.add_(update.to(p.dtype), alpha=-group["lr"] * coeff)

    def load_state_dict(self, state_dict: dict) -> None:
        """As DeepSpeed: loading into the warm-up resets each tensor's frozen coefficient, factor and
        scaling; loading into the compression phase keeps them. Error buffers and the flat buffer's
        padding restart at zero until the checkpoint's rank files restore this rank's own
        (load_rank_checkpoint_file)."""
        super().load_state_dict(self._prepare_state_dict(state_dict))
        step = self.first_state().get("step", 0)
        self.lamb_freeze_key = step >= self.freeze_step
        self.set_engine_allreduce(not self.lamb_freeze_key)
        if not self.lamb_freeze_key:
            for group in self.param_groups:
                for p in group["params"]:
                    s = self.state.get(p)
                    if s:
                        s["lamb_coeff_freeze"], s["last_factor"] = 0.0, 1.0
                        s.pop("scaling_coeff", None)
        self.initialize = step > 0
        self.reset_compression_errors()


def _drop_empty(params: Any) -> Any:
    """DeepSpeed's filter_empty_parameters: groups (or a list) without zero-element tensors."""
    params = list(params)
    if params and isinstance(params[0], dict):
        out = []
        for g in params:
            kept = [p for p in g["params"] if p.numel() > 0]
            if kept:
                out.append({**g, "params": kept})
        return out
    return [p for p in params if p.numel() > 0]
