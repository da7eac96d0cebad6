"""CPU reference of the dropout keep masks the CUDA kernel draws (csrc/cuda/transformer_dropout.cu):
Philox4x32-10 in numpy, word for word. The GPU tests compare the kernel's masks with it bit for bit;
the constants repeat csrc/include/dsc/transformer_cuda.h's DSC_PHILOX_*."""
from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
SALT0, SALT1 = 0x5DEECE66, 0x2545F491
_LOW32 = np.uint64(0xFFFFFFFF)


def keep_threshold(p: float) -> int:
    """The integer bound a Philox word must stay under for keep probability 1 - p."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in (0, 1) for a keep mask, got {p}")
    return min(int((1.0 - p) * 2.0 ** 32), 0xFFFFFFFF)


def _philox4x32_10(c: list[np.ndarray], k0: int, k1: int) -> list[np.ndarray]:
    x, y, z, w = c
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0 = x * np.uint64(M0)
        p1 = z * np.uint64(M1)
        x, y, z, w = ((p1 >> np.uint64(32)) ^ y ^ np.uint64(k0), p1 & _LOW32, (p0 >> np.uint64(32)) ^ w ^ np.uint64(k1),
                      p0 & _LOW32)
    return [x, y, z, w]


def dropout_keep(n: int, threshold: int, seed: int, offset: int) -> np.ndarray:
    """uint8 [n]: element e kept (1) when word e % 4 of philox((e // 4, offset), seed ^ salt) < threshold."""
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    ctr = [blocks & _LOW32, blocks >> np.uint64(32), np.full_like(blocks, offset & 0xFFFFFFFF),
           np.full_like(blocks, (offset >> 32) & 0xFFFFFFFF)]
    words = _philox4x32_10(ctr, (seed & 0xFFFFFFFF) ^ SALT0, ((seed >> 32) & 0xFFFFFFFF) ^ SALT1)
    return (np.stack(words, axis=1).reshape(-1)[:n] < np.uint64(threshold)).astype(np.uint8)
