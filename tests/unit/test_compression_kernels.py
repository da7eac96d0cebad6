"""The fused fake-quant C kernel (csrc/cpu/compress_quant.c) against the torch reference
(deepspeed_c/compression/quant_reference.py, torch's own per-op rounding): bit-equal for nearest rounding in
fp32, fp16 and bf16, per group, symmetric and asymmetric, 2..16 bits, fixed ranges, ternary and binary;
stochastic rounding lands on the grid and is unbiased; the backward is straight-through."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.compression import quant_kernels as K
from deepspeed_c.compression import quant_reference as R
from deepspeed_c.compression.utils import AsymQuantizer, SymQuantizer, TernaryQuantizer


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 4).to(dtype)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fake_quant_bit_equal_to_reference(dtype):
    assert K.kernel_for(torch.zeros(2, dtype=dtype)) is not None
    for seed, (shape, groups) in enumerate([((96, 40), 1), ((96, 40), 8), ((7, 33), 7), ((300, 257), 3)]):
        x = _x(shape, dtype, seed)
        for bits in (2, 3, 4, 8, 12, 16 if dtype != torch.float16 else 15):  # torch: 65535 overflows fp16
            for asym in (False, True):
                _bit_equal(K.fake_quant(x, bits, groups, asym), R.fake_quant(x, bits, groups, asym))


def test_fixed_range_zero_group_and_large_tensor():
    x = _x((64, 50), torch.float32)
    lo, hi = torch.tensor([[-1.5]]), torch.tensor([[0.75]])
    amax = torch.max(lo.abs(), hi)
    _bit_equal(K.fake_quant(x, 8, 1, True, lo=lo, hi=hi), R.fake_quant(x, 8, 1, True, None, lo, hi))
    _bit_equal(K.fake_quant(x, 4, 1, False, lo=amax, hi=amax), R.fake_quant(x, 4, 1, False, None, amax, amax))
    z = torch.zeros(4, 16)
    z[1] = _x((16,), torch.float32)
    _bit_equal(K.fake_quant(z, 8, 4), R.fake_quant(z, 8, 4))  # all-zero groups: NaN, as torch gives
    big = _x((1 << 18) + 12, torch.float32, seed=3)  # several tiles per group, OpenMP both passes
    for groups in (1, 2, 4):
        _bit_equal(K.fake_quant(big, 8, groups, True), R.fake_quant(big, 8, groups, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ternary_binary_bit_equal(dtype):
    x = _x((48, 20), dtype)
    for groups in (1, 4, 48):
        _bit_equal(K.ternary(x, groups), R.ternary(x, groups))
        _bit_equal(K.binary(x, groups), R.binary(x, groups))


def test_stochastic_rounding_on_grid_unbiased_and_seeded():
    x = torch.full((4, 20000), 0.3) + torch.linspace(0, 0.01, 20000)
    x[:, 0] = 1.0  # amax 1: scale 2/16 for 4 bits
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a = K.fake_quant(x, 4, 4, stochastic=True, generator=g1)
    b = K.fake_quant(x, 4, 4, stochastic=True, generator=g2)
    assert torch.equal(a, b)
    scale = 2.0 / 16
    codes = a / scale
    assert torch.equal(codes, codes.round())
    assert set(torch.unique(a[:, 1:]).tolist()) <= {0.25, 0.375}
    assert abs(a[:, 1:].double().mean().item() - x[:, 1:].double().mean().item()) < 2e-3
    nearest = K.fake_quant(x, 4, 4)
    assert torch.equal(torch.unique(nearest[:, 1:]), torch.tensor([0.25]))  # all below the 0.3125 midpoint


def test_straight_through_backward():
    x = _x((8, 6), torch.float32).requires_grad_()
    g = _x((8, 6), torch.float32, seed=1)
    for fn in (SymQuantizer, AsymQuantizer, TernaryQuantizer):
        (y,) = torch.autograd.grad(fn.apply(x, 4, None, None, 2), x, g)
        assert torch.equal(y, g)


def test_bad_input_named():
    op = K.kernel_for(torch.zeros(1))
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="'groups'"):
        op.fake_quant(x, torch.empty_like(x), 3, 8, 0, None, None, 0, 0)
    with pytest.raises(ValueError, match="'bits' must be 2..16"):
        op.fake_quant(x, torch.empty_like(x), 1, 17, 0, None, None, 0, 0)
    with pytest.raises(ValueError, match="'out'"):
        op.fake_quant(x, torch.empty(10, dtype=torch.float16), 1, 8, 0, None, None, 0, 0)
    with pytest.raises(ValueError, match="'thres' must have one element per group"):
        op.ternary(x, torch.empty_like(x), 2, torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="quantize_groups=3 does not divide"):
        K.fake_quant(x, 8, 3)
