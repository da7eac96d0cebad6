"""FusedLamb: DeepSpeed's FusedLamb (LAMB, You et al. 2019) for CUDA parameters, with its exact
arithmetic (trust ratio clamp(||p|| / ||u||, min_coeff, max_coeff) per tensor, bias correction
folded into the step size) but multi-tensor: three launches per bucket of tensors instead of
three per tensor. State: per-parameter 0-dim float32 `step`, float32 `exp_avg`, `exp_avg_sq`."""
from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed_c.ops import fused_optimizer_utils as fu

_MOMENTS = ("exp_avg", "exp_avg_sq")
_op = None


def _load_op() -> Any:
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import FusedLambBuilder

        _op = FusedLambBuilder().load()
    return _op


def multi_tensor_lamb(grads: list[torch.Tensor], params: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                      step: int, weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                      eps_inside_sqrt: bool = False, bias_correction: bool = True, grad_scale: float = 1.0,
                      out_params: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One LAMB step over parallel lists of CUDA tensors, in place; returns the float32 trust
    ratio of each tensor (a device tensor, no synchronisation)."""
    n = len(params)
    device = params[0].device if n else torch.device("cuda")
    coeffs = torch.empty(n, dtype=torch.float32, device=device)
    scratch = torch.empty(2 * n, dtype=torch.float64, device=device)
    _load_op().multi_tensor_lamb(grads, params, exp_avgs, exp_avg_sqs, out_params, coeffs, scratch, float(lr),
                                 float(betas[0]), float(betas[1]), float(eps), int(step), bool(eps_inside_sqrt),
                                 bool(bias_correction), float(weight_decay), float(max_coeff), float(min_coeff),
                                 float(grad_scale))
    return coeffs


def _per_group(arg: Any, ngroups: int) -> list[Any]:
    """DeepSpeed's convention: None, a generator or flat list (one group), or a list of lists."""
    if arg is None:
        return [None] * ngroups
    if isinstance(arg, types.GeneratorType):
        return [list(arg)]
    if len(arg) == 0 or not isinstance(arg[0], list):
        return [arg]
    return arg


class FusedLamb(torch.optim.Optimizer):
    """Implements the LAMB algorithm on CUDA; DeepSpeed's signature, defaults and step()
    arguments (grads, output_params, scale, grad_norms). AMSGrad is not supported."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.lamb_coeffs: list[torch.Tensor] = []
        self._op = _load_op()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        fu.restore_fp32_moments(self, state_dict, _MOMENTS)

    def _host_step(self, closure: Any, grads: Any, output_params: Any, scale: float, grad_norms: Any) -> Any:
        """Host parameters, as DeepSpeed's FusedLamb on its CPU accelerator: the same arithmetic in torch
        (ops/lamb/cpu_lamb.py). DeepSpeed's deprecated per-call arguments are CUDA-only here."""
        for name, value in (("grads", grads), ("output_params", output_params), ("grad_norms", grad_norms)):
            if value is not None:
                raise NotImplementedError(f"FusedLamb.step({name}=...) on host parameters is not supported; "
                                          "set .grad and call step()")
        if float(scale) != 1.0:
            raise NotImplementedError("FusedLamb.step(scale=...) on host parameters is not supported")
        from deepspeed_c.ops.lamb.cpu_lamb import CPULamb

        loss = CPULamb.step(self, closure)
        self.lamb_coeffs = [torch.tensor(float(c)) for c in self.lamb_coeffs]
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        return [c.item() for c in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None,
             scale: float = 1.0, grad_norms: Any = None) -> Any:
        """grads: gradients to use instead of p.grad; output_params: fp16/bf16 copies of fp32
        params written in the same pass; scale: gradients are divided by it; grad_norms: the
        (scaled) gradient norm per group (a number, or one per parameter) for max_grad_norm."""
        with_grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if with_grads and all(p.device.type == "cpu" for p in with_grads):
            return self._host_step(closure, grads, output_params, scale, grad_norms)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ngroups = len(self.param_groups)
        grads_groups = _per_group(grads, ngroups)
        outs_groups = _per_group(output_params, ngroups)
        norm_groups = [None] * ngroups if grad_norms is None else grad_norms
        self.lamb_coeffs = []
        for group, g_grads, g_outs, g_norm in zip(self.param_groups, grads_groups, outs_groups, norm_groups):
            n = len(group["params"])
            g_grads = [None] * n if g_grads is None else g_grads
            g_outs = [None] * n if g_outs is None else g_outs
            norms = g_norm if isinstance(g_norm, (list, tuple)) else [g_norm] * n
            params, gl, outs, scales, states = [], [], [], [], []
            for p, grad, out, norm in zip(group["params"], g_grads, g_outs, norms):
                if p.grad is None and grad is None:
                    continue
                grad = p.grad if grad is None else grad
                fu.check_param(p, grad, "FusedLamb")
                combined = float(scale)
                if group["max_grad_norm"] > 0 and norm is not None:
                    clip = ((float(norm) / scale) + 1e-6) / group["max_grad_norm"]  # the norm carries the scale
                    if clip > 1:
                        combined = clip * scale
                state = self.state[p]
                if len(state) == 0:
                    fu.init_state(state, group, p, _MOMENTS)
                else:
                    fu.normalize_state(state, p, _MOMENTS)
                params.append(p)
                gl.append(fu.contiguous_grad(grad))
                outs.append(out)
                scales.append(combined)
                states.append(state)
            if not params:
                continue
            steps = fu.advance_steps(states)
            keys = zip((p.device for p in params), steps, scales, (o is None for o in outs))
            coeffs: list[torch.Tensor | None] = [None] * len(params)
            for (_, step, combined, no_out), idx in fu.bucket(keys).items():
                c = multi_tensor_lamb(
                    [gl[i] for i in idx], [params[i] for i in idx], [states[i]["exp_avg"] for i in idx],
                    [states[i]["exp_avg_sq"] for i in idx], lr=group["lr"], betas=group["betas"],
                    eps=group["eps"], step=step, weight_decay=group["weight_decay"],
                    max_coeff=group["max_coeff"], min_coeff=group["min_coeff"],
                    eps_inside_sqrt=self.eps_mode == 0, bias_correction=bool(group["bias_correction"]),
                    grad_scale=combined, out_params=None if no_out else [outs[i] for i in idx])
                for i, ci in zip(idx, c.unbind()):
                    coeffs[i] = ci
            self.lamb_coeffs.extend(c for c in coeffs if c is not None)
        return loss
