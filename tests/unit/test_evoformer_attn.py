"""DS4Sci_EvoformerAttention on the host (the chunked torch path the CUDA kernels mirror) against a
float64 naive implementation that materialises every score: outputs and the gradients of Q, K,
V and both biases. The CUDA kernels are checked against the same naive math on a GPU by
.devrun/gpu_41.sh (tests/unit/test_cuda_build.py compiles them here)."""
from __future__ import annotations

import math

import pytest
import torch

from deepspeed_c.ops.deepspeed4science import DS4Sci_EvoformerAttention
from deepspeed_c.ops.deepspeed4science import evoformer_reference as ref


def naive(q, k, v, bias1, bias2):
    """softmax(q k^T / sqrt(D) + biases) v with [B, N, H, L, L] scores, by autograd."""
    qh, kh, vh = (t.transpose(-2, -3) for t in (q, k, v))  # [B, N, H, L, D]
    s = torch.matmul(qh, kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    for b in (bias1, bias2):
        if b is not None:
            s = s + b
    return torch.matmul(torch.softmax(s, dim=-1), vh).transpose(-2, -3)


def make(B, N, L, H, D, dtype=torch.float64, seed=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, N, L, H, D, generator=g, dtype=dtype) for _ in range(3))
    keep = torch.rand(B, N, 1, 1, L, generator=g) > 0.3 if masked else torch.ones(B, N, 1, 1, L, dtype=torch.bool)
    keep[..., 0] = True  # every row sees at least one key
    bias1 = (1e9 * (keep.to(dtype) - 1)).to(dtype)  # OpenFold's mask bias
    bias2 = torch.randn(B, 1, H, L, L, generator=g, dtype=dtype)
    return q, k, v, bias1, bias2


def grads(fn, inputs, d_o):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*leaves)
    out.backward(d_o)
    return out.detach(), [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("L,D,use1,use2", [(17, 8, True, True), (33, 16, False, True), (40, 32, True, False),
                                           (9, 4, False, False)])
def test_matches_naive_float64(L, D, use1, use2):
    q, k, v, b1, b2 = make(2, 3, L, 2, D)
    b1 = b1 if use1 else None
    b2 = b2 if use2 else None
    d_o = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, wg = grads(naive, (q, k, v, b1, b2), d_o)
    got, gg = grads(lambda *a: DS4Sci_EvoformerAttention(a[0], a[1], a[2], [a[3], a[4]]), (q, k, v, b1, b2), d_o)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(("dQ", "dK", "dV", "dbias1", "dbias2"), gg, wg):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_chunking_and_float32_path():
    """Query chunks smaller than L (the memory bound) give the same numbers; float32 inputs keep
    float32 math and stay within float32 rounding of the float64 result."""
    q, k, v, b1, b2 = make(1, 2, 29, 3, 8, seed=3)
    scale = 1 / math.sqrt(8)
    o_full, lse_full = ref.forward(q, k, v, b1, b2, scale, chunk=64)
    o_small, lse_small = ref.forward(q, k, v, b1, b2, scale, chunk=5)
    torch.testing.assert_close(o_small, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_small, lse_full, rtol=1e-12, atol=1e-12)
    d_o = torch.randn_like(q)
    g_full = ref.backward(d_o, q, k, v, o_full, lse_full, b1, b2, scale, True, True, chunk=64)
    g_small = ref.backward(d_o, q, k, v, o_full, lse_full, b1, b2, scale, True, True, chunk=7)
    for a, b in zip(g_small, g_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    want, wg = grads(naive, (q, k, v, b1, b2), d_o)
    f32 = [t.float() for t in (q, k, v, b1, b2)]
    got, gg = grads(lambda *a: DS4Sci_EvoformerAttention(a[0], a[1], a[2], [a[3], a[4]]), f32, d_o.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    for a, b in zip(gg, wg):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4)


def test_bfloat16_on_host_accumulates_in_float32():
    q, k, v, b1, b2 = make(1, 2, 21, 2, 16, seed=4)
    want = naive(q, k, v, b1, b2)
    got = DS4Sci_EvoformerAttention(q.bfloat16(), k.bfloat16(), v.bfloat16(), [b1.bfloat16(), b2.bfloat16()])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_fully_masked_row_gives_zeros_without_nan():
    q, k, v, _, b2 = make(1, 1, 12, 1, 4, seed=5)
    b1 = torch.full((1, 1, 1, 1, 12), float("-inf"), dtype=torch.float64)
    b1[..., :3] = 0
    b2 = b2.clone()
    b2[0, 0, 0, 4] = float("-inf")  # one query row additionally loses every visible key
    b2[0, 0, 0, 4, :3] = float("-inf")
    q.requires_grad_(True)
    out = DS4Sci_EvoformerAttention(q, k, v, [b1, b2])
    assert torch.equal(out[0, 0, 4], torch.zeros_like(out[0, 0, 4]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_bad_input_names_the_expected_shape():
    q, k, v, b1, b2 = make(2, 3, 10, 2, 4)
    with pytest.raises(ValueError, match=r"biases\[0\] \(the mask bias\) must have shape \[B, N, 1, 1, L\] = "
                                         r"\[2, 3, 1, 1, 10\]"):
        DS4Sci_EvoformerAttention(q, k, v, [b1.transpose(-1, -3), b2])
    with pytest.raises(ValueError, match=r"biases\[1\] \(the pair bias\) must have shape \[B, 1, H, L, L\] = "
                                         r"\[2, 1, 2, 10, 10\]"):
        DS4Sci_EvoformerAttention(q, k, v, [b1, b2[:, :, :1]])
    with pytest.raises(ValueError, match=r"Q must be \[B, N, L, H, D\]"):
        DS4Sci_EvoformerAttention(q[0], k[0], v[0], [])
    with pytest.raises(ValueError, match=r"K must have Q's shape"):
        DS4Sci_EvoformerAttention(q, k[:, :, :5], v, [])
    with pytest.raises(TypeError, match="unsupported dtype torch.int64"):
        DS4Sci_EvoformerAttention(q.long(), k.long(), v.long(), [])
    with pytest.raises(TypeError, match="must match Q's dtype"):
        DS4Sci_EvoformerAttention(q, k.float(), v, [])
    with pytest.raises(ValueError, match="at most two"):
        DS4Sci_EvoformerAttention(q, k, v, [b1, b2, b2])


def test_cuda_binding_refuses_bad_arguments_by_name():
    """The CUDA op checks every argument before a kernel runs (no GPU needed to see it)."""
    from op_builder import toolchain
    if toolchain.nvcc() is None or not toolchain.cudart_static_available():
        pytest.skip("nvcc and libcudart_static are needed to build the op")
    from deepspeed_c.ops.deepspeed4science.evoformer_attn import cuda_op

    op = cuda_op()
    q = torch.zeros(1, 2, 8, 2, 16, dtype=torch.float16)
    lse = torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="'q' must be on the cuda device"):
        op.forward(q, q, q, None, None, q, lse, 0.25)
    with pytest.raises(TypeError, match="argument 'q'.*(dtype|float32)"):
        op.forward_tc(q.float(), q, q, None, None, q, lse, 0.25)
    with pytest.raises(TypeError, match="takes exactly 16 arguments"):
        op.backward(q, q, q)
