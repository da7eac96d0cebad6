"""The quantizers in plain torch: the reference the C and CUDA kernels (csrc/cpu/compress_quant.c,
csrc/cuda/compress_quant.cu) are checked against, and the path for devices without a kernel.

Every operation runs in the tensor's own dtype, one rounding per operation, in the order DeepSpeed 0.19.6's
quantizers use, which is what makes the kernels bit-equal to DeepSpeed for nearest rounding:

    symmetric   scale = 2 * amax / 2^bits           q = clamp(round(x / scale), -2^(bits-1), 2^(bits-1) - 1)
    asymmetric  scale = (max - min) / 2^bits         zp = round(min / scale) * scale
                q = clamp(round((x - zp) / scale), 0, 2^bits - 1)            x' = q * scale + zp
    ternary     thres = 0.7 * mean|x|; alpha = mean of |x| over |x| > thres; x' = alpha * sign(x) where |x| > thres
    binary      x' = sign(x) * mean|x|
per group (x viewed as (groups, -1)); `round` is half-to-even. Stochastic rounding adds uniform noise in
[-0.5, 0.5) before rounding (MoQ's `rounding: stochastic`)."""
from __future__ import annotations

from typing import Optional

import torch


def group_range(x: torch.Tensor, groups: int, asym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per group, shaped (groups, 1): (min, max) for asymmetric, (unused, amax) for symmetric."""
    flat = x.reshape(groups, -1)
    if asym:
        return flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
    amax = torch.amax(torch.abs(flat), dim=-1).view(groups, -1)
    return amax, amax


def fake_quant(x: torch.Tensor, bits: int, groups: int = 1, asym: bool = False,
               noise: Optional[torch.Tensor] = None, lo: Optional[torch.Tensor] = None,
               hi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x quantized to `bits` and back. `lo`/`hi` give a fixed range (static activation quantization: min and
    max for asymmetric, and for symmetric hi is max(|min|, max)); `noise` (x's shape) is added before rounding."""
    q_range = 2 ** bits
    shape = x.shape
    flat = x.reshape(groups, -1)
    if lo is None or hi is None:
        lo, hi = group_range(x, groups, asym)
    if asym:
        scale = (hi - lo) / q_range
        zero_point = (lo / scale).round() * scale
        v = (flat - zero_point) / scale
        if noise is not None:
            v = v + noise.reshape(groups, -1)
        out = v.round().clamp(0, q_range - 1) * scale + zero_point
    else:
        scale = 2 * hi / q_range
        v = flat / scale
        if noise is not None:
            v = v + noise.reshape(groups, -1)
        out = v.round().clamp(-q_range // 2, q_range // 2 - 1) * scale
    return out.reshape(shape).contiguous()


def ternary_stats(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(thres, alpha) per group, shaped (groups, 1)."""
    flat = x.reshape(groups, -1)
    n = flat.shape[1]
    thres = (0.7 * flat.norm(p=1, dim=1).div(n)).view(-1, 1)
    mask = (flat.abs() > thres).type(x.type())
    alpha = ((mask * flat).abs().sum(dim=1) / mask.sum(dim=1)).view(-1, 1)
    return thres, alpha


def ternary_apply(x: torch.Tensor, thres: torch.Tensor, alpha: torch.Tensor, groups: int) -> torch.Tensor:
    flat = x.reshape(groups, -1)
    pos = (flat > thres).type(x.type())
    neg = (flat < -thres).type(x.type())
    return (alpha * pos - alpha * neg).reshape(x.shape).contiguous()


def ternary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    thres, alpha = ternary_stats(x, groups)
    return ternary_apply(x, thres, alpha, groups)


def binary_scale(x: torch.Tensor, groups: int) -> torch.Tensor:
    flat = x.reshape(groups, -1)
    return flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])


def binary_apply(x: torch.Tensor, m: torch.Tensor, groups: int) -> torch.Tensor:
    return x.reshape(groups, -1).sign().mul(m).reshape(x.shape).contiguous()


def binary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    return binary_apply(x, binary_scale(x, groups), groups)
