"""Float64 references and input makers for the CUDA multi-tensor kernel tests. The references are
written from the algorithms' definitions (DeepSpeed's FusedAdam/FusedLamb/FusedLion arithmetic),
not from the kernels."""
from __future__ import annotations

import math

import torch

# Sizes that are not multiples of the vector width (4) or the chunk (16384), plus empty and
# 1-element tensors.
RAGGED = [0, 1, 3, 4, 5, 7, 31, 1023, 2049, 16383, 16384, 16385, 40001, 65537, 100003]
HALF_RTOL = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
NEEDS_GPU = "CUDA kernels need a CUDA GPU (none visible here); they are compile-checked by test_cuda_build"


def make(sizes: list[int], dtype: torch.dtype, misalign: bool = False, scale: float = 1.0,
         positive: bool = False) -> list[torch.Tensor]:
    """Fresh random CUDA tensors; misalign=True offsets each by one element from a 16-byte
    aligned allocation, so the kernels take their scalar path."""
    out = []
    for n in sizes:
        base = torch.randn(n + (1 if misalign else 0), device="cuda", dtype=torch.float32) * scale
        if positive:
            base = base.abs() + 1e-3
        t = base.to(dtype)
        out.append(t[1:] if misalign else t)
    return out


def poison(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    for t in ts:
        t.fill_(float("nan"))
    return ts


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().flatten(), ref.double().flatten()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel(outs: list[torch.Tensor], refs: list[torch.Tensor], tol: float, what: str) -> None:
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o.numel() == 0:
            continue
        assert torch.isfinite(o.double()).all(), f"{what}[{i}] has non-finite values (unwritten?)"
        e = rel_err(o, r)
        assert e <= tol, f"{what}[{i}] (numel {o.numel()}): relative error {e:.3e} > {tol:.1e}"


def assert_half_close(outs: list[torch.Tensor], refs: list[torch.Tensor], what: str) -> None:
    """Low-precision outputs: within one unit of their last place of the float64 reference."""
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o.numel() == 0:
            continue
        rtol = HALF_RTOL[o.dtype]
        torch.testing.assert_close(o.double(), r.double(), rtol=rtol, atol=rtol * 1e-3,
                                   msg=lambda m, i=i: f"{what}[{i}]: {m}")


def adam_ref(p, g, m, v, *, lr, beta1, beta2, eps, step, weight_decay, adam_w_mode=True,
             bias_correction=True, grad_scale=1.0):
    """One Adam/AdamW step in float64; returns (p, m, v)."""
    p, g, m, v = p.double(), g.double() / grad_scale, m.double(), v.double()
    if not adam_w_mode:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    upd = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + eps)
    if adam_w_mode:
        upd = upd + weight_decay * p
    return p - lr * upd, m, v


def lamb_ref(ps, gs, ms, vs, *, lr, beta1, beta2, eps, step, weight_decay, max_coeff, min_coeff,
             eps_inside_sqrt=False, bias_correction=True, grad_scale=1.0):
    """One DeepSpeed-FusedLamb step per tensor in float64; returns (ps, ms, vs, coeffs)."""
    out_p, out_m, out_v, coeffs = [], [], [], []
    if bias_correction:
        step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    else:
        step_size = lr
    for p, g, m, v in zip(ps, gs, ms, vs):
        p, g, m, v = p.double(), g.double() / grad_scale, m.double(), v.double()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
        u = m / denom + weight_decay * p
        wn, un = p.norm().item(), u.norm().item()
        c = 1.0
        if wn != 0 and un != 0:
            c = min(max(wn / un, min_coeff), max_coeff)
        out_p.append(p - step_size * c * u)
        out_m.append(m)
        out_v.append(v)
        coeffs.append(c)
    return out_p, out_m, out_v, coeffs


def lion_ref(p, g, m, *, lr, beta1, beta2, weight_decay):
    """One Lion step in float64; returns (p, m, c) with c the sign argument (for tie masking)."""
    p, g, m = p.double(), g.double(), m.double()
    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * torch.sign(c)
    return p, beta2 * m + (1 - beta2) * g, c
