"""random-LTD's token moves in C (csrc/cpu/random_ltd.c, the reference the CUDA kernels are checked against on
the GPU by benchmarks/data_efficiency.py): gather, scatter (replace, add, zero), mask slicing, bit for bit
against torch.gather/scatter in every float dtype and both layouts; bad input named; and the wrapped layer's
gradients through them equal the dense layer's on the kept tokens (test_random_ltd_layer.py runs that through
the same ops: here we only make sure the C op is the one in use on the host)."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.random_ltd import GatherTokens, ScatterTokens, gpt_sample_tokens, token_ops

B, S, H, K = 3, 11, 6, 5
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _op():
    op = token_ops._op("cpu")
    assert op is not None, "the C reference of the random-LTD token moves did not build"
    return op


def _case(dtype: torch.dtype, batch_first: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (B, S, H) if batch_first else (S, B, H)
    x = torch.randn(shape, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B)]).to(torch.int32)  # unsorted on purpose
    part_shape = (B, K, H) if batch_first else (K, B, H)
    part = torch.randn(part_shape, generator=g).to(dtype)
    pos = (idx.long() if batch_first else idx.long().t()).unsqueeze(-1).expand(-1, -1, H)
    return x, idx, part, pos, 1 if batch_first else 0


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moves_equal_torch_bit_for_bit(dtype, batch_first):
    _op()
    x, idx, part, pos, dim = _case(dtype, batch_first)
    assert torch.equal(token_ops.gather(x, idx, batch_first), torch.gather(x, dim, pos))
    assert torch.equal(token_ops.scatter(x, part, idx, batch_first), x.scatter(dim, pos, part))
    assert torch.equal(token_ops.scatter(x, None, idx, batch_first), x.scatter(dim, pos, 0.0))
    # add: one rounding of the fp32 (fp64) sum, as torch's scatter_add of distinct positions does
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    want = x.to(wide).scatter_add(dim, pos, part.to(wide)).to(dtype)
    assert torch.equal(token_ops.scatter(x, part, idx, batch_first, accumulate=True), want)
    zeros_plus = torch.zeros_like(x).scatter(dim, pos, part)
    assert torch.equal(token_ops.scatter(None, part, idx, batch_first, accumulate=True, like=x), zeros_plus)


@pytest.mark.parametrize("mask_batch,heads", [(1, 1), (B, 2)])
def test_mask_slicing_keeps_the_rows_and_columns(mask_batch, heads):
    _op()
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B)]).to(torch.int32)
    for mask in (torch.randn(mask_batch, heads, S, S, generator=g), torch.rand(mask_batch, heads, S, S, generator=g) > 0.5):
        out = token_ops.mask_gather(mask, idx)
        full = mask.expand(B, -1, -1, -1)
        want = torch.stack([full[b][:, idx[b].long()][:, :, idx[b].long()] for b in range(B)])
        assert out.dtype == mask.dtype and torch.equal(out, want)


def test_bad_input_is_named():
    op = _op()
    x, idx, part, _, _ = _case(torch.float32, True)
    out = torch.empty(B, K, H)
    with pytest.raises(TypeError, match="'idx'"):
        op.gather(x, idx.long(), True, out)
    with pytest.raises(ValueError, match="'out' must have shape"):
        op.gather(x, idx, True, torch.empty(B, K + 1, H))
    with pytest.raises(ValueError, match="outside"):
        op.gather(x, torch.full_like(idx, S), True, out)
    twice = idx.clone()
    twice[0, 1] = twice[0, 0]
    with pytest.raises(ValueError, match="kept twice"):
        op.scatter(x, part, twice, True, False, None, torch.empty_like(x))
    with pytest.raises(TypeError, match="'part' must have the dtype"):
        op.scatter(x, part.double(), idx, True, False, None, torch.empty_like(x))


def test_gather_scatter_autograd_through_the_c_reference_float64():
    _op()
    x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    idx = gpt_sample_tokens(K, S, B)[0][0]
    w = torch.randn(H, H, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        full, kept = GatherTokens.apply(x, idx, True)
        return ScatterTokens.apply(full * 2.0, torch.tanh(kept @ w), idx, True)

    assert torch.autograd.gradcheck(f, (x, w))
