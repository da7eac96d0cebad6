"""Dispatch of the quantizers: the C kernel (csrc/cpu/compress_quant.c) for host tensors, the CUDA kernel
(csrc/cuda/compress_quant.cu) for device tensors, both fused (one call quantizes and dequantizes) and
bit-equal to the torch reference (quant_reference), which runs for other devices or dtypes and when
DSC_COMPRESS_REFERENCE=1. The group statistics of ternary / binary (float sums) come from torch, as
DeepSpeed computes them; the kernels apply them."""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch

from deepspeed_c.compression import quant_reference as R

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _op(device_type: str) -> Any:
    from deepspeed_c.ops.op_builder import CompressQuantBuilder, CompressQuantCUDABuilder

    return (CompressQuantBuilder if device_type == "cpu" else CompressQuantCUDABuilder)().load()


def kernel_for(x: torch.Tensor) -> Optional[Any]:
    """The op that takes `x`, or None for the torch reference."""
    if os.environ.get("DSC_COMPRESS_REFERENCE") == "1" or x.dtype not in _KERNEL_DTYPES or x.numel() == 0:
        return None
    if x.device.type not in ("cpu", "cuda"):
        return None
    return _op(x.device.type)


def _per_group(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to(device=x.device, dtype=torch.float32).contiguous()


def fake_quant(x: torch.Tensor, bits: int, groups: int = 1, asym: bool = False, stochastic: bool = False,
               lo: Optional[torch.Tensor] = None, hi: Optional[torch.Tensor] = None,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """x quantized to `bits` per group and back (see quant_reference.fake_quant); `lo`/`hi` fix the range."""
    op = kernel_for(x) if 2 <= bits <= 16 else None
    fixed = lo is not None
    if op is not None and fixed and (x.dtype != torch.float32 or lo.dtype != torch.float32 or groups != 1):
        op = None  # torch promotes a half tensor against an fp32 range: the reference does it the same way
    if op is None:
        noise = x.new(x.shape).uniform_(-0.5, 0.5, generator=generator) if stochastic else None
        return R.fake_quant(x, bits, groups, asym, noise, lo, hi)
    if x.numel() % groups:
        raise ValueError(f"quantize_groups={groups} does not divide the {x.numel()} elements of the tensor")
    src = x.detach().contiguous()
    out = torch.empty_like(src)
    seed = int(torch.randint(1, 2 ** 62, (1,), generator=generator).item()) if stochastic else 0
    # torch divides a bf16/fp16 CPU tensor by a one-element tensor as x * (1 / s): the kernel follows
    recip = int(x.device.type == "cpu" and x.dtype != torch.float32 and groups == 1)
    op.fake_quant(src, out, groups, bits, int(asym), _per_group(lo, x) if fixed else None,
                  _per_group(hi, x) if fixed else None, recip, seed)
    return out.view(x.shape)


def ternary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    thres, alpha = R.ternary_stats(x.detach(), groups)
    op = kernel_for(x)
    if op is None:
        return R.ternary_apply(x, thres, alpha, groups)
    src = x.detach().contiguous()
    out = torch.empty_like(src)
    op.ternary(src, out, groups, _per_group(thres, x), _per_group(alpha, x))
    return out.view(x.shape)


def binary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    m = R.binary_scale(x.detach(), groups)
    op = kernel_for(x)
    if op is None:
        return R.binary_apply(x, m, groups)
    src = x.detach().contiguous()
    out = torch.empty_like(src)
    op.binary(src, out, groups, _per_group(m, x))
    return out.view(x.shape)
