"""The Python face of the 1-bit compression core (csrc/cpu/onebit.c, csrc/cuda/onebit.cu).

A flat float32 buffer is described by a segment table, int64 rows (offset, length, scale index)
with offsets on byte boundaries of the bit buffer (multiples of 8). The core computes, one pass
each: `compensate` (buffer += error, sums of squares per scale index), `pack` (sign bits, and the
new error buffer - scale * sign) and `unpack` (scale * sign, or added to the output). Bits are
least-significant-first: element k is bit k % 8 of byte k // 8."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch


@functools.lru_cache(maxsize=None)
def _cpu_op() -> Any:
    from deepspeed_c.ops.op_builder.onebit import OnebitBuilder

    return OnebitBuilder().load()


@functools.lru_cache(maxsize=None)
def _cuda_op() -> Any:
    from deepspeed_c.ops.op_builder.onebit import OnebitCUDABuilder

    return OnebitCUDABuilder().load()


def op_for(device: torch.device) -> Any:
    if device.type == "cpu":
        return _cpu_op()
    if device.type == "cuda":
        return _cuda_op()
    raise NotImplementedError(f"1-bit compression runs on cpu and cuda tensors, got {device.type}")


def compensate(y: torch.Tensor, err: Optional[torch.Tensor], segs: torch.Tensor, sumsq: torch.Tensor,
               max_len: int) -> None:
    op_for(y.device).compensate(y, err, segs, sumsq, int(max_len))


def pack(y: torch.Tensor, err: Optional[torch.Tensor], bits: torch.Tensor, segs: torch.Tensor, scales: torch.Tensor,
         max_len: int) -> None:
    op_for(y.device).pack(y, err, bits, segs, scales, int(max_len))


def unpack(bits: torch.Tensor, out: torch.Tensor, segs: torch.Tensor, scales: torch.Tensor, accumulate: bool,
           max_len: int) -> None:
    op_for(out.device).unpack(bits, out, segs, scales, bool(accumulate), int(max_len))


def whole(n: int, device: torch.device) -> torch.Tensor:
    """The segment table of one segment covering n elements with scale index 0."""
    return torch.tensor([[0, n, 0]], dtype=torch.int64, device=device)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's packbits: the sign bits of a float32 tensor ((numel + 7) // 8 bytes)."""
    x = x.detach().reshape(-1).to(torch.float32).contiguous()
    bits = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=x.device)
    ones = torch.ones(1, dtype=torch.float32, device=x.device)
    pack(x, None, bits, whole(x.numel(), x.device), ones, x.numel())
    return bits


def unpack_signs(bits: torch.Tensor, numel: int, scale: float = 1.0) -> torch.Tensor:
    """scale * sign (+1/-1 float32) for the first numel elements of packed bits."""
    if bits.dtype != torch.uint8 or bits.dim() != 1:
        raise TypeError(f"bits must be a 1-D uint8 tensor, got {bits.dtype} with {bits.dim()} dims")
    if numel < 0 or (numel + 7) // 8 > bits.numel():
        raise ValueError(f"numel {numel} needs {(numel + 7) // 8} bytes of bits, got {bits.numel()}")
    out = torch.empty(numel, dtype=torch.float32, device=bits.device)
    scales = torch.full((1,), float(scale), dtype=torch.float32, device=bits.device)
    unpack(bits.contiguous(), out, whole(numel, bits.device), scales, False, numel)
    return out
