"""The fused inference kernels on a GPU against their torch reference (reference.py, float32 math)
over random shapes: odd head counts and head dims, GQA ratios 1-8, query lengths and cache
lengths that are not multiples of the 32-key tile, padding masks, split-key decode; fp32, fp16 and
bf16; the MoE expert GEMVs. Then kernel-injected GPT-2, LLaMA-family and Mixtral models on the GPU: the same 64 greedy tokens as
HF eager in fp32 (with and without CUDA graphs, left-padded batches and beam search included) and bf16/fp16 logits
no further from the fp32 model's than HF eager's own in that dtype allows."""
from __future__ import annotations

import math

import pytest
import torch

from deepspeed_c.ops.transformer.inference import kernels as K
from deepspeed_c.ops.transformer.inference import reference as R
from tests.unit.inference_models import VOCAB, greedy, injected_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the CUDA kernels run against their torch reference there; "
                                       "the host path is tested in test_kernel_inject.py)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}

# the GEMM path rounds the scores and the probabilities to the dtype between its steps (as HF eager
# attention does); the float32 reference does not
GEMM_TOL = {torch.float16: dict(rtol=5e-3, atol=5e-3), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_norm(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols, with_y, with_bias, layer_norm, with_r in [
            (1, 60, True, True, True, True), (7, 1600, True, True, True, True), (33, 2048, True, False, False, True),
            (5, 4097, False, False, False, False), (3, 100, False, True, True, False), (16, 12288, True, True, False, True), (2, 16384, True, True, True, True)]:
        x = _rand(rows, cols, dtype=dtype, gen=gen)
        y = _rand(rows, cols, dtype=dtype, gen=gen) if with_y else None
        b = _rand(cols, dtype=dtype, gen=gen) if with_bias else None
        g = _rand(cols, dtype=dtype, gen=gen)
        beta = _rand(cols, dtype=dtype, gen=gen) if layer_norm else None
        outs = []
        for fn in (K.add_norm, R.add_norm):
            r = torch.full_like(x, float("nan")) if with_r else None
            n = torch.full_like(x, float("nan"))
            fn(x, y, b, g, beta, 1e-5, r, n)
            outs.append((r, n))
        if with_r:
            torch.testing.assert_close(outs[0][0], outs[1][0], **TOL[dtype])
        torch.testing.assert_close(outs[0][1], outs[1][1], **TOL[dtype])


def _rope_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    ang = torch.arange(positions, device="cuda").float()[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().contiguous(), ang.sin().contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qkv_rotary_cache(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for b, t, h, hkv, d, past, s, rotary, bias in [
            (1, 1, 32, 4, 64, 600, 640, True, False), (2, 37, 5, 1, 24, 0, 64, True, True),
            (3, 9, 6, 2, 80, 45, 100, True, True), (2, 19, 9, 3, 128, 13, 50, False, True),
            (1, 70, 25, 25, 64, 0, 96, False, True), (4, 1, 2, 1, 256, 33, 40, True, False)]:
        width = (h + 2 * hkv) * d
        qkv = _rand(b, t, width, dtype=dtype, gen=gen)
        bb = _rand(width, dtype=dtype, gen=gen) if bias else None
        cos, sin = _rope_tables(s, d) if rotary else (None, None)
        pos = torch.randint(0, s, (b, t), device="cuda", generator=gen) if rotary else None
        past_dev = torch.tensor([past], dtype=torch.int32, device="cuda")
        base_k, base_v = _rand(b, hkv, s, d, dtype=dtype, gen=gen), _rand(b, hkv, s, d, dtype=dtype, gen=gen)
        res = []
        for use_kernel in (True, False):
            kc, vc = base_k.clone(), base_v.clone()
            q = torch.full((b, t, h, d), float("nan"), dtype=dtype, device="cuda")
            if use_kernel:
                K.qkv_rotary_cache(qkv, bb, cos, sin, pos, past, past_dev, kc, vc, q, h, hkv, d, d)
            else:
                R.qkv_rotary_cache(qkv, bb, cos, sin, pos, past, kc, vc, q, h, hkv, d, d)
            res.append((q, kc, vc))
        for got, want in zip(res[0], res[1]):
            torch.testing.assert_close(got, want, **TOL[dtype])


ATTN_CASES = [  # B, T, H, Hkv, D, past, S, splits, padded
    (1, 1, 32, 4, 64, 600, 640, None, False),    # decode, GQA 8, split keys
    (16, 1, 32, 4, 64, 511, 640, None, True),    # decode at batch 16
    (2, 37, 5, 1, 24, 0, 64, 1, True),           # prefill, 5 heads on 1 kv head, odd T
    (3, 1, 6, 2, 80, 45, 100, None, False),
    (2, 19, 9, 3, 100, 13, 50, 3, True),         # D not a multiple of 32, 3 splits
    (1, 70, 4, 4, 128, 0, 96, 1, False),
    (2, 1, 2, 1, 256, 33, 40, None, False),      # D = 256
    (1, 5, 3, 3, 17, 10, 33, 7, True),           # odd D, more splits than key tiles
    (1, 1, 7, 7, 64, 0, 16, None, False),        # the first decode token
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention(dtype):
    gen = torch.Generator(device="cuda").manual_seed(2)
    for b, t, h, hkv, d, past, s, splits, padded in ATTN_CASES:
        q = _rand(b, t, h, d, dtype=dtype, gen=gen)
        kc, vc = _rand(b, hkv, s, d, dtype=dtype, gen=gen), _rand(b, hkv, s, d, dtype=dtype, gen=gen)
        mask = torch.ones(b, s, dtype=torch.int32, device="cuda")
        if padded:  # left padding of a different length per row; row 0 unpadded
            for i in range(1, b):
                mask[i, : min(i * 3, past + t - 1)] = 0
        past_dev = torch.tensor([past], dtype=torch.int32, device="cuda")
        scale = 1.0 / math.sqrt(d)
        want = torch.empty_like(q)
        R.attention(q, kc, vc, past, mask, scale, want)
        want_nomask = torch.empty_like(q)
        R.attention(q, kc, vc, past, None, scale, want_nomask)
        for method in ("fused", "gemm"):  # the decode kernel and the prefill GEMMs + masked softmax
            case = f"{(b, t, h, hkv, d, past, s, splits)} {method}"
            got = torch.full_like(q, float("nan"))
            K.attention(q, kc, vc, past, past_dev, mask, scale, got, splits=splits, method=method)
            tol = TOL[dtype] if method == "fused" or dtype == torch.float32 else GEMM_TOL[dtype]
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{case}: {m}")
            # the same without a mask, in one split
            K.attention(q, kc, vc, past, past_dev, None, scale, got, splits=1, method=method)
            torch.testing.assert_close(got, want_nomask, **tol, msg=lambda m: f"{case}, no mask: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activations(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows, f in [(1, 6400), (37, 88), (512, 5632)]:
        for approximate in (True, False):
            h = _rand(rows, f, dtype=dtype, gen=gen)
            bias = _rand(f, dtype=dtype, gen=gen)
            a, r = h.clone(), h.clone()
            K.bias_gelu(a, bias, approximate)
            R.bias_gelu(r, bias, approximate)
            torch.testing.assert_close(a, r, **TOL[dtype])
        gu = _rand(rows, 2 * f, dtype=dtype, gen=gen)
        for bias in (None, _rand(2 * f, dtype=dtype, gen=gen)):
            a, r = torch.empty(rows, f, dtype=dtype, device="cuda"), torch.empty(rows, f, dtype=dtype, device="cuda")
            K.silu_mul(gu, bias, a)
            R.silu_mul(gu, bias, r)
            torch.testing.assert_close(a, r, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_gemv(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for tokens, k, experts, n, c in [(1, 2, 8, 96, 256), (3, 2, 5, 40, 48), (8, 4, 16, 33, 1000), (2, 1, 3, 7, 13)]:
        w = _rand(experts, n, c, dtype=dtype, gen=gen, scale=0.1)
        idx = torch.randint(0, experts, (tokens, k), device="cuda", generator=gen)
        idx[0, 0] = experts  # outside [0, E): adds nothing
        x = _rand(tokens, c, dtype=dtype, gen=gen)
        out = torch.empty(tokens * k, n, dtype=dtype, device="cuda")
        want = torch.empty(tokens * k, n, dtype=torch.float64, device="cuda")  # float64: no TF32 in the reference
        K.moe_gemv(x, idx, None, w, out, combine=False)
        R.moe_gemv(x.double(), idx, None, w.double(), want, combine=False)
        torch.testing.assert_close(out.double(), want, **TOL[dtype])
        assert out[0].abs().max().item() == 0.0
        act = _rand(tokens * k, c, dtype=dtype, gen=gen)
        wts = torch.rand(tokens, k, device="cuda", generator=gen)
        out = torch.empty(tokens, n, dtype=dtype, device="cuda")
        want = torch.empty(tokens, n, dtype=torch.float64, device="cuda")
        K.moe_gemv(act, idx, wts, w, out, combine=True)
        R.moe_gemv(act.double(), idx, wts, w.double(), want, combine=True)
        torch.testing.assert_close(out.double(), want, **TOL[dtype])
    with pytest.raises(ValueError, match="'x' must have shape"):
        K.moe_gemv(x[:, :-1].contiguous(), idx, None, w, torch.empty(tokens * k, n, dtype=dtype, device="cuda"),
                   combine=False)


def test_binding_rejects_bad_input():
    op = K.cuda_op()
    x = torch.zeros(2, 8, device="cuda")
    with pytest.raises(TypeError, match="'gamma' must have the dtype of 'x'"):
        op.add_norm(x, None, None, torch.ones(8, device="cuda", dtype=torch.float16), None, 1e-5, None, x.clone())
    with pytest.raises(ValueError, match="'gamma' must hold 8 elements"):
        op.add_norm(x, None, None, torch.ones(7, device="cuda"), None, 1e-5, None, x.clone())
    q = torch.zeros(1, 1, 6, 16, device="cuda")
    kc = torch.zeros(1, 4, 8, 16, device="cuda")
    past = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="multiple of the cache's 4 kv heads"):
        op.attention(q, kc, kc, past, None, 1.0, torch.empty_like(q), None, 1)
    q4 = torch.zeros(1, 1, 4, 16, device="cuda")
    with pytest.raises(ValueError, match="'workspace' must hold"):
        op.attention(q4, kc, kc, past, None, 1.0, torch.empty_like(q4), None, 2)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_wide", "mistral", "qwen2", "mixtral"])
def test_injected_fp32_greedy_equals_hf_eager(kind, graphs):
    ref, inj = injected_pair(kind, max_out_tokens=128, enable_cuda_graph=graphs)
    ref, inj = ref.cuda(), inj.cuda()
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4)).cuda()
    seq_ref, logits_ref = greedy(ref, ids, 64)
    seq_inj, logits_inj = greedy(inj, ids, 64)
    assert torch.equal(seq_inj, seq_ref)
    torch.testing.assert_close(logits_inj, logits_ref, rtol=1e-3, atol=1e-3)
    # a second sequence through the same (captured) model, left-padded
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    seq_ref, logits_ref = greedy(ref, ids, 32, mask)
    seq_inj, logits_inj = greedy(inj, ids, 32, mask)
    assert torch.equal(seq_inj, seq_ref)
    torch.testing.assert_close(logits_inj, logits_ref, rtol=1e-3, atol=1e-3)
    # beam search reorders the cache in place (under the captured graph too)
    kw = dict(max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(inj.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["gpt2", "llama_wide", "qwen2", "mixtral"])
def test_injected_half_logits_within_dtype_tolerance(kind, dtype):
    ref32, _ = injected_pair(kind)
    ref32 = ref32.cuda()
    ref_half, inj_half = injected_pair(kind, dtype=dtype, enable_cuda_graph=True)
    ref_half, inj_half = ref_half.to("cuda", dtype), inj_half.cuda()
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        want = ref32(ids).logits
        hf_err = (ref_half(ids).logits.float() - want).abs().max().item()
        inj_err = (inj_half(ids).logits.float() - want).abs().max().item()
    scale = want.abs().max().item()
    # our kernels round less often than HF's separate ops; allow 2x HF's own error plus an ulp
    assert inj_err <= 2 * hf_err + scale * (2 ** -7), (inj_err, hf_err, scale)
    # and the decode path (graph replays) stays within the same bound over 16 steps
    seq_half, logits_half = greedy(inj_half, ids, 16)
    with torch.no_grad():
        want_steps = ref32(seq_half[:, :-1]).logits[:, ids.shape[1] - 1:]
        hf_steps = ref_half(seq_half[:, :-1]).logits[:, ids.shape[1] - 1:].float()
    hf_err = (hf_steps - want_steps).abs().max().item()
    inj_err = (logits_half.float() - want_steps).abs().max().item()
    assert inj_err <= 2 * hf_err + scale * (2 ** -7), (inj_err, hf_err, scale)
