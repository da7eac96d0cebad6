"""Block-wise int8/int4 quantization (csrc/cpu/quantize.c) against a NumPy reference written here from
the layout in dsc/quantize.h: the same codes and scales exactly (every step is one correctly rounded
fp32 operation), the round trip within half a block's scale, over odd sizes, segments, input dtypes
and the scalar and vector builds; bad arguments raise naming them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepspeed_c.ops import quantizer as qz


def reference(x: np.ndarray, bits: int, block: int, segments: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (int, one per element) and fp32 scales of x (fp32), segment by segment, block by block."""
    qmax = np.float32(7 if bits == 4 else 127)
    codes, scales = [], []
    for seg in x.reshape(segments, -1):
        for start in range(0, seg.size, block):
            b = seg[start:start + block]
            scale = np.float32(np.abs(b).max()) / qmax
            scales.append(scale)
            c = np.zeros(b.size) if scale == 0 else np.clip(np.rint(b / scale), -qmax, qmax)
            codes.append(c.astype(np.int64))
    return np.concatenate(codes), np.array(scales, dtype=np.float32)


def unpack(q: np.ndarray, bits: int, seg: int, segments: int) -> np.ndarray:
    if bits == 8:
        return q.view(np.int8).astype(np.int64)
    out = []
    for s in q.reshape(segments, -1):
        nib = np.stack([s & 0xF, s >> 4], axis=1).reshape(-1)[:seg].astype(np.int64)
        out.append(np.where(nib >= 8, nib - 16, nib))
    return np.concatenate(out)


SIZES = [(1, 1, 8), (1, 7, 4), (3, 1001, 200), (4, 2049, 2048), (2, 5, 2), (1, 20_001, 512), (5, 333, 64)]


@pytest.mark.parametrize("simd", [None, "scalar"])
@pytest.mark.parametrize("bits", [8, 4])
def test_codes_scales_and_round_trip_match_reference(simd, bits) -> None:
    op = qz.quantizer._cpu_op() if simd is None else __import__(
        "deepspeed_c.ops.op_builder", fromlist=["x"]).QuantizerBuilder(simd="scalar").load()
    g = torch.Generator().manual_seed(bits)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for segments, seg, block in SIZES:
            x = (torch.randn(segments * seg, generator=g) * torch.rand(1, generator=g) * 10).to(dtype)
            x[::97] = 0  # zeros inside blocks, and all-zero blocks below
            if seg >= 2 * block:
                x[:block] = 0
            nq, ns = qz.packed_sizes(seg, bits, block, segments)
            q = torch.empty(nq, dtype=torch.uint8)
            scales = torch.empty(ns, dtype=torch.float32)
            op.quantize(x, segments, block, bits, q, scales)
            xf = x.float().numpy()
            ref_codes, ref_scales = reference(xf, bits, block, segments)
            np.testing.assert_array_equal(scales.numpy(), ref_scales)
            np.testing.assert_array_equal(unpack(q.numpy(), bits, seg, segments), ref_codes)
            back = torch.empty(segments * seg, dtype=torch.float32)
            op.dequantize(q, scales, segments, block, bits, back)
            # the round trip: within half the block's scale, plus the fp32 rounding of code * scale
            per_elem = np.concatenate([np.repeat(ref_scales[s * len(ref_scales) // segments:
                                                            (s + 1) * len(ref_scales) // segments], block)[:seg]
                                       for s in range(segments)]).astype(np.float64)
            err = np.abs(back.numpy().astype(np.float64) - xf.astype(np.float64))
            bound = per_elem / 2 + np.abs(back.numpy().astype(np.float64)) * 2.0 ** -24
            assert np.all(err <= bound), (dtype, segments, seg, block, (err - bound).max())
            # the 16-bit output is the fp32 value rounded once
            if dtype != torch.float32:
                back16 = torch.empty(segments * seg, dtype=dtype)
                op.dequantize(q, scales, segments, block, bits, back16)
                assert torch.equal(back16, back.to(dtype))
            # the reduction: segments summed in order, in fp32
            total = torch.empty(seg, dtype=torch.float32)
            op.dequantize_sum(q, scales, segments, block, bits, total)
            want = np.zeros(seg, dtype=np.float32)
            for s in back.numpy().reshape(segments, seg):
                want = want + s
            np.testing.assert_array_equal(total.numpy(), want)


def test_front_end_shapes_and_bad_arguments() -> None:
    x = torch.randn(10)
    q, s = qz.quantize(x, 4, 4, 2)
    assert q.numel() == 2 * 3 and s.numel() == 2 * 2  # segments of 5: 3 bytes and 2 blocks each
    y = qz.dequantize(q, s, 10, 4, 4, 2, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (10,)
    with pytest.raises(ValueError, match="bits"):
        qz.quantize(x, 3)
    with pytest.raises(ValueError, match="even"):
        qz.quantize(x, 4, 5)
    with pytest.raises(ValueError, match="segments"):
        qz.quantize(x, 8, 4, 3)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        qz.quantize(x.double())
    op = qz.quantizer._cpu_op()
    with pytest.raises(ValueError, match="q_out"):
        op.quantize(x, 1, 4, 8, torch.empty(9, dtype=torch.uint8), torch.empty(3))
    with pytest.raises(ValueError, match="scales_out"):
        op.quantize(x, 1, 4, 8, torch.empty(10, dtype=torch.uint8), torch.empty(2))
    with pytest.raises(TypeError, match="q"):
        op.dequantize(torch.empty(10), torch.empty(3), 1, 4, 8, torch.empty(10))
    with pytest.raises(ValueError, match="'q'"):
        op.dequantize_sum(q, s, 2, 4, 4, torch.empty(7))  # segments of 7 elements take 4 bytes each, not 3


@pytest.mark.skipif(__import__("op_builder").toolchain.nvcc() is None, reason="nvcc is needed to build quantizer_cuda")
def test_cuda_binding_refuses_host_tensors_naming_them() -> None:
    """The CUDA build (compiled here without a GPU) validates before any CUDA call."""
    from deepspeed_c.ops.op_builder import QuantizerCUDABuilder

    op = QuantizerCUDABuilder().load()
    with pytest.raises(ValueError, match="'x' must be on the cuda device"):
        op.quantize(torch.zeros(8), 1, 8, 8, torch.empty(8, dtype=torch.uint8), torch.empty(1))


def test_non_finite_block_comes_back_nan_others_exact() -> None:
    """An inf or NaN (an fp16 overflow) makes its whole block NaN, so the overflow check still sees it."""
    x = torch.randn(64)
    ref_q, ref_s = qz.quantize(x.clone(), 8, 16)
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[20] = bad
        q, s = qz.quantize(y, 8, 16)
        back = qz.dequantize(q, s, 64, 8, 16)
        assert torch.isnan(back[16:32]).all()
        assert torch.equal(back[:16], qz.dequantize(ref_q, ref_s, 64, 8, 16)[:16])
        assert torch.equal(back[32:], qz.dequantize(ref_q, ref_s, 64, 8, 16)[32:])
