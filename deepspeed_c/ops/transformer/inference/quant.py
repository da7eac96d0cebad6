"""Weight-only int8 / int4 linear layers: quantization on the host, the dequantize-GEMM on a GPU (CUDA op
`transformer_inference`: quant_gemv for decode, dequantize + cuBLAS GEMM for prefill) and its torch reference.

Symmetric, one float32 scale per (output row, group of `group` consecutive inputs):
    s = absmax(group) / qmax  (qmax 127 for int8, 7 for int4),  q = clamp(round(w / s), -qmax, qmax)
int4 values are packed two a byte: input k even in the low nibble, k odd in the high one, each stored as
q + 8 (0..15)."""
from __future__ import annotations

import torch
from torch import Tensor
import torch.nn.functional as F

QMAX = {8: 127, 4: 7}
GEMV_MAX_ROWS = 8  # the CUDA GEMV serves up to this many activation rows (decode); more go to a GEMM
CHUNK = {8: 16, 4: 32}  # weights a 16-byte load of the GEMV: width and group must be multiples of it
_GEMV_MAX_CHUNKS = 65536


def gemv_serves(rows: int, k: int, bits: int, group: int) -> bool:
    """Whether quant_gemv takes this shape (else dequantize + GEMM)."""
    w = CHUNK[bits]
    return 1 <= rows <= GEMV_MAX_ROWS and k % w == 0 and group % w == 0 and k // w < _GEMV_MAX_CHUNKS


def check_group(what: str, in_features: int, bits: int, group: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quant: num_bits={bits} is not supported (8 or 4)")
    if group < 1 or in_features % group != 0:
        raise ValueError(f"quant: {what} has input width {in_features}, which is not a multiple of the "
                         f"quantization group ({group}): choose q_groups / group_size dividing it")
    if bits == 4 and in_features % 2 != 0:
        raise ValueError(f"quant: int4 packs two inputs a byte: {what}'s input width {in_features} must be even")


@torch.no_grad()
def quantize(weight: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor]:
    """(q, scales) of a [N, K] weight: q int8 [N, K] (8 bits) or uint8 [N, K / 2] (4 bits), scales fp32 [N, K / group]."""
    n, k = weight.shape
    check_group("the weight", k, bits, group)
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    absmax = w.abs().amax(dim=2)
    scales = torch.where(absmax > 0, absmax / QMAX[bits], torch.ones_like(absmax))
    q = torch.round(w / scales.unsqueeze(2)).clamp_(-QMAX[bits], QMAX[bits]).reshape(n, k).to(torch.int8)
    if bits == 4:
        u = (q + 8).to(torch.uint8)
        q = u[:, 0::2] | (u[:, 1::2] << 4)
    return q.contiguous(), scales.contiguous()


def dequantize_reference(q: Tensor, scales: Tensor, bits: int, group: int, dtype: torch.dtype) -> Tensor:
    if bits == 8:
        vals = q.to(torch.float32)
    else:
        lo = (q & 15).to(torch.float32) - 8
        hi = (q >> 4).to(torch.float32) - 8
        vals = torch.stack([lo, hi], dim=2).reshape(q.shape[0], q.shape[1] * 2)
    n, k = vals.shape
    w = vals.reshape(n, k // group, group) * scales.unsqueeze(2)
    return w.reshape(n, k).to(dtype)


def dequantize(q: Tensor, scales: Tensor, bits: int, group: int, dtype: torch.dtype) -> Tensor:
    if not q.is_cuda:
        return dequantize_reference(q, scales, bits, group, dtype)
    from deepspeed_c.ops.transformer.inference.kernels import cuda_op

    k = q.shape[1] * (1 if bits == 8 else 2)
    out = torch.empty(q.shape[0], k, dtype=dtype, device=q.device)
    cuda_op().dequantize(q, scales, out, bits, group)
    return out


def gemv(x2: Tensor, q: Tensor, scales: Tensor, bits: int, group: int, variant: int = 0) -> Tensor:
    """The CUDA GEMV on x2 [rows, K] (rows <= GEMV_MAX_ROWS); variant: a launch for tuning (0 = default)."""
    from deepspeed_c.ops.transformer.inference.kernels import cuda_op

    if x2.data_ptr() % 16:  # the kernel reads activations 16 bytes at a time
        x2 = x2.clone()
    out = torch.empty(x2.shape[0], q.shape[0], dtype=x2.dtype, device=x2.device)
    cuda_op().quant_gemv(x2, q, scales, out, bits, group, variant)
    return out


def linear(x: Tensor, q: Tensor, scales: Tensor, bits: int, group: int, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ dequant(q)^T (+ bias) in x's dtype."""
    k = x.shape[-1]
    rows = x.numel() // k
    if x.is_cuda and gemv_serves(rows, k, bits, group) and q.data_ptr() % 16 == 0:
        out = gemv(x.reshape(rows, k).contiguous(), q, scales, bits, group)
        out = out.view(*x.shape[:-1], q.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, dequantize(q, scales, bits, group, x.dtype), bias)
