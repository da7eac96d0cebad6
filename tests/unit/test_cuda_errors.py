"""Bad input to the CUDA multi-tensor ops raises a Python exception naming the argument, before
any kernel runs: CPU tensors in a CUDA list, mixed devices, mismatched list lengths, sizes and
dtypes, non-contiguous tensors, short workspaces."""
from __future__ import annotations

import pytest
import torch

from tests.unit.cuda_reference import NEEDS_GPU

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_GPU)

HP = (1e-3, 0.9, 0.999, 1e-8, 1, True, True, 0.0, 1.0)  # lr .. grad_scale of multi_tensor_adam


@pytest.fixture(scope="module")
def adam():
    from op_builder.fused_adam import FusedAdamBuilder

    return FusedAdamBuilder().load()


@pytest.fixture(scope="module")
def ops():
    from op_builder.multi_tensor import MultiTensorOpsBuilder

    return MultiTensorOpsBuilder().load()


def _f32(*sizes):
    return [torch.randn(n, device="cuda") for n in sizes]


def test_mixed_devices(adam):
    g = _f32(4, 4)
    p = [torch.randn(4, device="cuda"), torch.randn(4)]
    with pytest.raises(ValueError, match=r"'params\[1\]' must be on the cuda device"):
        adam.multi_tensor_adam(g, p, _f32(4, 4), _f32(4, 4), None, *HP)


def test_mismatched_lengths_and_sizes(adam):
    with pytest.raises(ValueError, match="'grads' and 'exp_avgs' must have the same length"):
        adam.multi_tensor_adam(_f32(4, 4), _f32(4, 4), _f32(4), _f32(4, 4), None, *HP)
    with pytest.raises(ValueError, match=r"'grads\[1\]' has 5 elements but 'params\[1\]' has 4"):
        adam.multi_tensor_adam(_f32(4, 5), _f32(4, 4), _f32(4, 4), _f32(4, 4), None, *HP)


def test_dtypes(adam):
    bf = [torch.randn(4, device="cuda", dtype=torch.bfloat16)]
    with pytest.raises(TypeError, match=r"'exp_avgs\[0\]' must be float32, got bfloat16"):
        adam.multi_tensor_adam(_f32(4), _f32(4), bf, _f32(4), None, *HP)
    ints = [torch.zeros(4, device="cuda", dtype=torch.int32)]
    with pytest.raises(TypeError, match=r"'grads\[0\]' must be"):
        adam.multi_tensor_adam(ints, _f32(4), _f32(4), _f32(4), None, *HP)
    with pytest.raises(ValueError, match="'out_params' is a low-precision copy of float32 'params'"):
        adam.multi_tensor_adam(bf, bf, _f32(4), _f32(4), bf, *HP)


def test_non_contiguous(adam):
    p = [torch.randn(4, 4, device="cuda").t()]
    with pytest.raises(ValueError, match=r"'params\[0\]' must be contiguous"):
        adam.multi_tensor_adam(_f32(16), p, _f32(16), _f32(16), None, *HP)


def test_short_workspace_and_outputs(ops):
    t = _f32(10, 10, 10)
    with pytest.raises(ValueError, match="'scratch' must hold at least 5 elements"):
        ops.l2norm(t, torch.empty(4, dtype=torch.float64, device="cuda"), torch.empty(1, device="cuda"), None, None)
    with pytest.raises(TypeError, match="'scratch' must be float64"):
        ops.l2norm(t, torch.empty(5, device="cuda"), torch.empty(1, device="cuda"), None, None)
    with pytest.raises(ValueError, match="'per_tensor_out' must hold at least 3"):
        ops.l2norm(t, torch.empty(5, dtype=torch.float64, device="cuda"), torch.empty(1, device="cuda"),
                   torch.empty(2, device="cuda"), None)
    with pytest.raises(ValueError, match="'norm_out' must be on the cuda device"):
        ops.l2norm(t, torch.empty(5, dtype=torch.float64, device="cuda"), torch.empty(1), None, None)


def test_epilogue_arguments(ops):
    g = _f32(8)
    with pytest.raises(ValueError, match="'loss_scale' must be > 0"):
        ops.adam_epilogue(g, _f32(8), _f32(8), _f32(8), None, torch.ones(1, device="cuda"), None,
                          torch.zeros(1, device="cuda"), 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 0.0, 1.0)
    with pytest.raises(ValueError, match="'step' must be on the cuda device"):
        ops.adam_epilogue(g, _f32(8), _f32(8), _f32(8), None, torch.ones(1, device="cuda"), None,
                          torch.zeros(1), 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0, 1.0)


def test_flatten_overlap_and_size(ops):
    flat = torch.empty(20, device="cuda")
    with pytest.raises(ValueError, match=r"'tensors\[0\]' overlaps 'flat'"):
        ops.flatten([flat[:10], torch.empty(10, device="cuda")], flat)
    with pytest.raises(ValueError, match="'flat' has 20 elements but the tensors hold 19"):
        ops.flatten(_f32(10, 9), flat)
