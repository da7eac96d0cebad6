import math

import pytest
import torch

from deepspeed_c.ops import cpu_multi_tensor as mt
from deepspeed_c.ops.op_builder import CPUMultiTensorBuilder, toolchain
from tests.unit.cpu_optim_reference import assert_rel

SIMD_PATHS = [s for s in ("avx512", "avx2", "scalar") if not toolchain.missing_isa(s)]


@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_and_scale_match_float64(simd, dtype):
    op = CPUMultiTensorBuilder(simd=simd).load()
    ts = [torch.randn(n).to(dtype) for n in (1, 17, 1024, 1025, 4099, 0)]
    sumsq, bad = op.sumsq(ts)
    want = sum(float((t.double() ** 2).sum()) for t in ts)
    assert not bad and math.isclose(sumsq, want, rel_tol=1e-12)
    before = [t.clone() for t in ts]
    op.scale_(ts, 0.37)
    for t, b in zip(ts, before):
        assert torch.equal(t, (b.float() * 0.37).to(dtype))  # one fp32 multiply, then rounding


@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_detected(poison):
    ts = [torch.randn(100), torch.randn(3000)]
    ts[1][2047] = poison
    norm, found = mt.global_l2_norm(ts)
    assert found and not math.isfinite(norm)
    assert math.isnan(mt.multi_tensor_global_norm(ts).item()) == math.isnan(torch.cat(ts).norm().item())


def test_global_norm_front_end_matches_torch():
    ts = [torch.randn(n) for n in (5, 1000, 3)]
    assert_rel(mt.multi_tensor_global_norm(ts), torch.cat([t.double() for t in ts]).norm(), 1e-7, "norm")
    big = [torch.full((10,), 1e20)]  # squares overflow fp32 but not the double accumulator
    norm, found = mt.global_l2_norm(big)
    assert not found and math.isclose(norm, 1e20 * math.sqrt(10), rel_tol=1e-6)


def test_bad_input():
    with pytest.raises(TypeError, match=r"'tensors\[0\]' must be float32 or float16 or bfloat16, got int64"):
        mt.global_l2_norm([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="'factor' must be a float"):
        CPUMultiTensorBuilder().load().scale_([torch.zeros(3)], "2")
