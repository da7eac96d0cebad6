"""The Python face of block-wise quantization (csrc/cpu/quantize.c, csrc/cuda/quantize.cu; layout in
csrc/include/dsc/quantize.h).

A tensor of `segments` equal segments is quantized block by block inside each segment: per block one
fp32 scale (largest magnitude / qmax, qmax = 127 for 8 bits and 7 for 4), codes rounded half to even,
so a value comes back within half its block's scale. Segments are what collectives need: each rank's
chunk of an all-gather or all-to-all buffer carries its own blocks and starts its codes on a byte.

Block sizes used by ZeRO++ (DeepSpeed sizes its groups adaptively: under 8 K elements for weights,
about one matrix row for gradients; ours are fixed, so the scale overhead and the error bound are known
in advance): WEIGHT_BLOCK elements per int8 block for qwZ (4 bytes of scale per 2048 codes: 0.2 %), and
GRAD_BLOCK per int4 block for qgZ (4 bytes of scale per 64 bytes of codes: 6 %; larger int4 blocks
lose the small gradients of a block)."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

WEIGHT_BLOCK = 2048
GRAD_BLOCK = 128
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _cpu_op() -> Any:
    from deepspeed_c.ops.op_builder import QuantizerBuilder

    return QuantizerBuilder().load()


@functools.lru_cache(maxsize=None)
def _cuda_op() -> Any:
    from deepspeed_c.ops.op_builder import QuantizerCUDABuilder

    return QuantizerCUDABuilder().load()


def op_for(device: torch.device) -> Any:
    if device.type == "cpu":
        return _cpu_op()
    if device.type == "cuda":
        return _cuda_op()
    raise NotImplementedError(f"deepspeed_c quantizer: runs on cpu and cuda tensors, got {device.type}")


def packed_sizes(seg: int, bits: int, block: int, segments: int = 1) -> tuple[int, int]:
    """(bytes of codes, number of scales) of `segments` segments of `seg` elements."""
    seg_bytes = (seg + 1) // 2 if bits == 4 else seg
    return segments * seg_bytes, segments * (-(-seg // block))


def _check_bits(bits: int, block: int) -> None:
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if block < 1 or (bits == 4 and block % 2):
        raise ValueError(f"block must be a positive{' even' if bits == 4 else ''} number of elements, got {block!r}")


@torch.no_grad()
def quantize(x: torch.Tensor, bits: int = 8, block: int = WEIGHT_BLOCK, segments: int = 1,
             q_out: Optional[torch.Tensor] = None,
             scales_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, scales fp32) of x (fp32, bf16 or fp16, contiguous), cut into `segments` equal segments."""
    if x.dtype not in _FLOATS:
        raise TypeError(f"quantize: x must be float32, bfloat16 or float16, got {x.dtype}")
    _check_bits(bits, block)
    if segments < 1 or x.numel() % segments:
        raise ValueError(f"quantize: segments ({segments}) must be >= 1 and divide x's {x.numel()} elements")
    nq, ns = packed_sizes(x.numel() // segments, bits, block, segments)
    q = torch.empty(nq, dtype=torch.uint8, device=x.device) if q_out is None else q_out
    scales = torch.empty(ns, dtype=torch.float32, device=x.device) if scales_out is None else scales_out
    op_for(x.device).quantize(x.contiguous(), segments, block, bits, q, scales)
    return q, scales


@torch.no_grad()
def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, bits: int = 8, block: int = WEIGHT_BLOCK,
               segments: int = 1, dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The `numel` values (in `dtype`, or into `out`) that codes q and scales stand for."""
    _check_bits(bits, block)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=q.device)
    op_for(q.device).dequantize(q, scales, segments, block, bits, out)
    return out


@torch.no_grad()
def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, seg: int, segments: int, bits: int = 4,
                   block: int = GRAD_BLOCK, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [seg]: the `segments` quantized segments dequantized and summed elementwise (in segment order)."""
    _check_bits(bits, block)
    if out is None:
        out = torch.empty(seg, dtype=torch.float32, device=q.device)
    op_for(q.device).dequantize_sum(q, scales, segments, block, bits, out)
    return out
