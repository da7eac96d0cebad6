"""Float64 references for the CPU optimizer tests, written from the update rules (torch.optim's
Adam/AdamW/Adagrad and the Lion paper), independent of the C code."""
from __future__ import annotations

import math

import torch


def adam_ref(p, g, m, v, *, lr, beta1, beta2, eps, wd, step, adamw, bias_correction=True):
    p, g, m, v = (t.double() for t in (p, g, m, v))
    if not adamw and wd:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    if adamw and wd:
        p = p * (1 - lr * wd)
    p = p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v


def adagrad_ref(p, g, s, *, lr, eps, wd):
    p, g, s = (t.double() for t in (p, g, s))
    g = g + wd * p
    s = s + g * g
    return p - lr * g / (s.sqrt() + eps), s


def lion_ref(p, g, m, *, lr, beta1, beta2, wd):
    p, g, m = (t.double() for t in (p, g, m))
    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * wd) - lr * torch.sign(c)
    return p, beta2 * m + (1 - beta2) * g


def ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of the representable values of t's dtype at |t| (float64 tensor)."""
    info = torch.finfo(t.dtype)
    a = t.double().abs()
    exp = torch.floor(torch.log2(torch.clamp(a, min=info.smallest_normal)))
    return torch.pow(2.0, exp) * info.eps


FP32_EPS = 2.0 ** -24


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, what: str, scale: torch.Tensor | None = None) -> None:
    """One ulp of the storage dtype. `scale` (the magnitude of the operands the value was computed
    from) adds the unavoidable error of computing in fp32 when the result nearly cancels
    (beta * m + (1 - beta) * g close to 0): a few fp32 roundings of the operands."""
    assert got.dtype == want.dtype, what
    diff = (got.double() - want.double()).abs()
    tol = torch.maximum(ulp(want), ulp(got))
    if scale is not None:
        tol = tol + 4 * FP32_EPS * scale.double().abs()
    bad = diff > tol
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {got.numel()} elements differ by more than one "
                                 f"ulp; worst {diff[bad].max().item()} at tolerance {tol[bad].min().item()}")


def assert_rel(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    num = (got.double() - want.double()).norm()
    den = want.double().norm().clamp_min(1e-30)
    assert num / den <= tol, f"{what}: norm-wise relative error {float(num / den):.3e} > {tol}"
