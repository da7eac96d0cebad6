"""Group-scaled minifloat codes in plain torch (any device; the CPU reference of DeepSpeed's FP quantizer).

Format of one quantized tensor (what `encode` returns and `decode` reads): a uint8 tensor of shape
(groups, group_size * q_bits / 8 + 4). The input is flattened, zero-padded to whole groups of `group_size`
elements, and each group becomes one row:
  - bytes [0, group_size * q_bits / 8): the group's codes, q_bits each, packed little-endian (element i's bit b
    is bit (i * q_bits + b) of the row, counting from bit 0 of byte 0);
  - the last 4 bytes: the group's float32 scale (native byte order), absmax(group) / largest code value, so that
    value = scale * code_value.
A code is sign-magnitude: the top bit is the sign, the rest an E(e)M(m) minifloat with exponent bias
2**(e-1) - 1, subnormals when the exponent field is 0, and no infinities or NaN (every code is finite, so
E4M3 reaches 480, E3M2 28, E2M1 6). Values round to the nearest code, ties to the even code (or stochastically between the two
nearest), never overflowing, since the scale maps the group's absmax onto the largest code.
"""
from __future__ import annotations

import math

import torch

SCALE_BYTES = 4
# q_bits -> mantissa bits where DeepSpeed's quantizer fixes them (only 8-bit codes take the configured value)
FIXED_MANTISSA = {12: 4, 6: 2, 4: 1}
SUPPORTED_BITS = (4, 6, 8, 12)


def code_format(q_bits: int, mantissa_bits: int) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of a q_bits code; raises ValueError naming the bad argument."""
    if isinstance(q_bits, bool) or q_bits not in SUPPORTED_BITS:
        raise ValueError(f"q_bits must be one of {SUPPORTED_BITS}, got {q_bits!r}")
    man = FIXED_MANTISSA.get(q_bits, mantissa_bits)
    if isinstance(man, bool) or not isinstance(man, int) or not 0 <= man <= q_bits - 2:
        raise ValueError(f"mantissa_bits must be an int in [0, {q_bits - 2}] for q_bits={q_bits} (at least one "
                         f"exponent bit beside the sign), got {mantissa_bits!r}")
    return q_bits - 1 - man, man


def check_group_size(group_size: int, q_bits: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if (group_size * q_bits) % 8:
        raise ValueError(f"group_size * q_bits must fill whole bytes: group_size={group_size} with q_bits={q_bits} "
                         f"packs into {group_size * q_bits} bits; use a group_size that is a multiple of "
                         f"{8 // math.gcd(8, q_bits)}")


def magnitude_table(exp_bits: int, man_bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The value of every magnitude code 0 .. 2**(e+m) - 1, increasing (float32)."""
    codes = torch.arange(1 << (exp_bits + man_bits), dtype=torch.int64)
    e_field, m_field = codes >> man_bits, codes & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    frac = m_field.double() / (1 << man_bits)
    normal = (1.0 + frac) * torch.pow(2.0, (e_field - bias).double())
    subnormal = frac * 2.0 ** (1 - bias)
    return torch.where(e_field == 0, subnormal, normal).float().to(device)


def _pack(codes: torch.Tensor, q_bits: int) -> torch.Tensor:
    """(G, n) integer codes < 2**q_bits -> (G, n * q_bits / 8) uint8, little-endian bit order."""
    if q_bits == 8:
        return codes.to(torch.uint8)
    groups = codes.shape[0]
    shifts = torch.arange(q_bits, device=codes.device, dtype=torch.int32)
    bits = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(groups, -1, 8)
    weights = torch.tensor([1 << b for b in range(8)], device=codes.device, dtype=torch.int32)
    return (bits.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, q_bits: int, group_size: int) -> torch.Tensor:
    """Inverse of _pack: (G, group_size * q_bits / 8) uint8 -> (G, group_size) int64 codes."""
    if q_bits == 8:
        return packed.to(torch.int64)
    groups = packed.shape[0]
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    bits = bits.reshape(groups, group_size, q_bits)
    weights = torch.tensor([1 << b for b in range(q_bits)], device=packed.device, dtype=torch.int32)
    return (bits * weights).sum(-1).to(torch.int64)


def encode(x: torch.Tensor, q_bits: int, mantissa_bits: int, group_size: int,
           stochastic: bool = False) -> torch.Tensor:
    """Quantize x (any float dtype and shape) into the row-per-group uint8 layout described above."""
    exp_bits, man_bits = code_format(q_bits, mantissa_bits)
    check_group_size(group_size, q_bits)
    flat = x.detach().reshape(-1).float()
    groups = max(1, -(-flat.numel() // group_size))
    padded = torch.zeros(groups * group_size, dtype=torch.float32, device=x.device)
    padded[:flat.numel()] = flat
    rows = padded.view(groups, group_size)
    table = magnitude_table(exp_bits, man_bits, x.device)
    top = table[-1]
    absmax = rows.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    y = rows / scale.unsqueeze(1)
    mag = y.abs().clamp_(max=top)
    if stochastic:
        lower = (torch.searchsorted(table, mag, right=True) - 1).clamp_(0, table.numel() - 2)
        lo, hi = table[lower], table[lower + 1]
        up = torch.rand_like(mag) < (mag - lo) / (hi - lo)
        code = lower + up.to(torch.int64)
    else:
        midpoints = (table[1:] + table[:-1]) * 0.5
        code = torch.searchsorted(midpoints, mag)  # a tie lands on the lower code here
        tie = mag == midpoints[code.clamp(max=midpoints.numel() - 1)]
        code = code + (tie & (code % 2 == 1)).to(torch.int64)  # ties to the even code, as IEEE rounding
    code = code | ((y < 0).to(torch.int64) << (q_bits - 1))
    scale_bytes = scale.contiguous().view(torch.uint8).view(groups, SCALE_BYTES)
    return torch.cat([_pack(code, q_bits), scale_bytes], dim=1)


def decode(q: torch.Tensor, q_bits: int, mantissa_bits: int, group_size: int, shape: torch.Size | tuple,
           dtype: torch.dtype) -> torch.Tensor:
    """Dequantize rows made by encode back to a tensor of `shape` and `dtype`."""
    exp_bits, man_bits = code_format(q_bits, mantissa_bits)
    row_bytes = group_size * q_bits // 8 + SCALE_BYTES
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] != row_bytes:
        raise ValueError(f"quantized input must be uint8 rows of {row_bytes} bytes (group_size={group_size}, "
                         f"q_bits={q_bits}), got {q.dtype} of shape {tuple(q.shape)}")
    numel = math.prod(shape)
    if q.shape[0] * group_size < numel:
        raise ValueError(f"{q.shape[0]} groups of {group_size} hold fewer than the {numel} elements of shape "
                         f"{tuple(shape)}")
    scale = q[:, -SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1, 1)
    code = _unpack(q[:, :-SCALE_BYTES], q_bits, group_size)
    table = magnitude_table(exp_bits, man_bits, q.device)
    mag = table[code & ((1 << (q_bits - 1)) - 1)]
    vals = torch.where((code >> (q_bits - 1)).bool(), -mag, mag) * scale
    return vals.reshape(-1)[:numel].reshape(shape).to(dtype)
