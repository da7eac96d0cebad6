"""Weight-only int8 / int4 on a GPU: the quant_gemv (decode) and dequantize (prefill) CUDA kernels against the
torch reference (quant.dequantize_reference, float32 math) over dtypes, groups, row counts and the tuning
launches; then an injected LLaMA (head_dim 128) quantized to int4: prefill logits against HF eager run with the
dequantized weights, and decode steps (quant_gemv) against prefill (dequantize + GEMM) on the same positions."""
from __future__ import annotations

import copy

import pytest
import torch

import deepspeed_c
from deepspeed_c.ops.transformer.inference import quant as Q
from tests.unit.inference_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the host path is tested in test_inference_rest.py)")

# the output is rounded once to the activation dtype; float32 differs from the reference by summation order
REL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_gemv_and_dequantize_against_reference(dtype, bits):
    gen = torch.Generator(device="cuda").manual_seed(bits)
    for n, k, group in [(40, 256, 32), (33, 1024, 128), (7, 4096, 4096), (130, 11008, 64)]:
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.05
        q, s = Q.quantize(w, bits, group)
        deq = Q.dequantize_reference(q, s, bits, group, torch.float32)
        assert torch.equal(Q.dequantize(q, s, bits, group, dtype), deq.to(dtype))  # exact: one rounding each
        for rows in (1, 3, 8):
            x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
            ref = x.float() @ deq.t()
            variants = [0] if dtype == torch.float32 else [0, 802, 808, 404, 1804, 1402]
            for v in variants:
                got = Q.gemv(x, q, s, bits, group, v)
                assert got.dtype == dtype and got.shape == (rows, n)
                assert _rel(got, ref) < REL[dtype], (n, k, group, rows, v)
            # linear() takes the GEMV for these rows; a misaligned activation view is copied, not misread
            x_off = torch.randn(rows * k + 3, generator=gen, device="cuda").to(dtype)[3:].view(rows, k)
            assert _rel(Q.linear(x_off, q, s, bits, group), x_off.float() @ deq.t()) < REL[dtype]
    # shapes the vector kernels do not take: int4 group 16, int8 width 48 with group 24 (scalar dequantize)
    for b, k, group in [(4, 64, 16), (8, 48, 24)]:
        if b != bits:
            continue
        q, s = Q.quantize(torch.randn(5, k, generator=gen, device="cuda"), b, group)
        assert not Q.gemv_serves(1, k, b, group)
        deq = Q.dequantize_reference(q, s, b, group, torch.float32)
        assert torch.equal(Q.dequantize(q, s, b, group, dtype), deq.to(dtype))
        x = torch.randn(2, k, generator=gen, device="cuda").to(dtype)
        assert _rel(Q.linear(x, q, s, b, group), x.float() @ deq.t()) < REL[dtype]


def test_quant_gemv_rejects_bad_input():
    from deepspeed_c.ops.transformer.inference.kernels import cuda_op

    q, s = Q.quantize(torch.randn(8, 64, device="cuda"), 4, 16)
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int4 needs the input width \\(64\\) and group \\(16\\) multiples of 32"):
        cuda_op().quant_gemv(x, q, s, out, 4, 16)
    q, s = Q.quantize(torch.randn(8, 64, device="cuda"), 8, 16)
    with pytest.raises(ValueError, match="'x' must have 1 to 8 rows, got 9"):
        cuda_op().quant_gemv(torch.zeros(9, 64, device="cuda", dtype=torch.bfloat16), q, s,
                             torch.empty(9, 8, device="cuda", dtype=torch.bfloat16), 8, 16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuda_op().quant_gemv(torch.zeros(65, device="cuda", dtype=torch.bfloat16)[1:].view(1, 64), q, s, out, 8, 16)


@torch.no_grad()
def test_int4_injected_llama_prefill_and_decode_agree_with_dequantized_hf():
    base = tiny_model("llama_wide").to("cuda")  # hidden 512, intermediate 640, head_dim 128
    ref = copy.deepcopy(base)
    for m in ref.modules():  # HF eager with the dequantized weights (torch ops)
        if isinstance(m, torch.nn.Linear) and m is not ref.get_output_embeddings():
            q, s = Q.quantize(m.weight, 4, 32)
            m.weight.copy_(Q.dequantize_reference(q, s, 4, 32, torch.float32))
    ref.config._attn_implementation = "eager"
    engine = deepspeed_c.init_inference(copy.deepcopy(base), dtype=torch.float32, replace_with_kernel_inject=True,
                                        max_out_tokens=64, quant={"weight": {"num_bits": 4, "group_size": 32}})
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(5)).cuda()
    want = ref(input_ids=ids).logits
    got = engine(input_ids=ids).logits  # 12 rows: dequantize + GEMM
    assert _rel(got, want) < 1e-4
    # the last 4 positions one token at a time (quant_gemv) against the same positions of the prefill
    out = engine(input_ids=ids[:, :8], use_cache=True)
    assert _rel(out.logits, want[:, :8]) < 1e-4
    past = out.past_key_values
    for t in range(8, 12):
        step = engine(input_ids=ids[:, t:t + 1], past_key_values=past, use_cache=True)
        past = step.past_key_values
        assert _rel(step.logits[:, -1], want[:, t]) < 1e-4, t
