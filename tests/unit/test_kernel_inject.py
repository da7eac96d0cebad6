"""Kernel injection on the host (the torch reference of every fused kernel): injected tiny GPT-2,
LLaMA (GQA 5:1 with 5 heads; 4 kv heads for 4 heads), Mistral (GQA 3:1) and Qwen2 (q/k/v biases)
give HF eager's greedy tokens for 64 new tokens through `generate()` and its logits at every step
(fp32); a left-padded batch with an attention mask; beam search (the cache reordered); the errors
(KV cache overflow past max_out_tokens, a stale cache handle, tp_size > 1 without its group, an architecture without
kernels returns None). Also runs under transformers 4.35 (PYTHONPATH=/tmp/tf4, from .whl_tf4/; the
real DeepSpeed's injection needs its legacy tuple caches) except the qwen2 case (no Qwen2 there)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.inference_models import VOCAB, greedy, injected_pair, tiny_model


def _need_fused_experts() -> None:
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("Mixtral's fused expert tensors (gate_up_proj / down_proj) arrived in transformers 5")


def test_mixtral_prefill_grouped_experts_equal_the_decode_gemv_path():
    """The two expert paths of a Mixtral block (grouped GEMMs by expert for prefill, the expert-GEMV kernel path for
    decode and graph capture) give the same MLP output, against float64 math written out here."""
    _need_fused_experts()
    from deepspeed_c.module_inject.fused_moe_block import FusedMoEDecoderBlock

    ref, inj = injected_pair("mixtral")
    block = next(m for m in inj.modules() if isinstance(m, FusedMoEDecoderBlock)).double()
    n2 = torch.randn(13, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    probs = torch.softmax(n2 @ block.router.t(), dim=-1)
    wts, idx = torch.topk(probs, 2, dim=-1)
    wts = wts / wts.sum(-1, keepdim=True)
    want = torch.zeros_like(n2)
    for t in range(13):
        for j in range(2):
            gate, up = (block.gate_up[idx[t, j]] @ n2[t]).chunk(2)
            want[t] += wts[t, j] * (block.down[idx[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(block._experts_grouped(n2, idx, wts), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(block._experts_gemv(n2, idx, wts), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_mha", "mistral", "qwen2", "mixtral"])
def test_greedy_tokens_and_logits_equal_hf_eager(kind):
    if kind == "mixtral":
        _need_fused_experts()
    ref, inj = injected_pair(kind)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    seq_ref, logits_ref = greedy(ref, ids, 64)
    seq_inj, logits_inj = greedy(inj, ids, 64)
    assert torch.equal(seq_inj, seq_ref)
    torch.testing.assert_close(logits_inj, logits_ref, rtol=1e-4, atol=1e-4)
    # a second generate() on the same model starts a new sequence (the cache is not carried over)
    assert torch.equal(greedy(inj, ids[:1], 8)[0], greedy(ref, ids[:1], 8)[0])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_left_padded_batch_with_attention_mask(kind):
    ref, inj = injected_pair(kind)
    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    seq_ref, logits_ref = greedy(ref, ids, 16, mask)
    seq_inj, logits_inj = greedy(inj, ids, 16, mask)
    assert torch.equal(seq_inj, seq_ref)
    torch.testing.assert_close(logits_inj, logits_ref, rtol=1e-4, atol=1e-4)


def test_beam_search_equals_hf_eager():
    ref, inj = injected_pair("llama")
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(inj.generate(ids, **kw), ref.generate(ids, **kw))


def test_errors():
    from deepspeed_c.module_inject.kernel_inject import inject
    _, inj = injected_pair("llama", max_out_tokens=20)
    ids = torch.randint(3, VOCAB, (1, 12))
    with pytest.raises(ValueError, match="max_out_tokens=20"):
        greedy(inj, ids, 10)
    with torch.no_grad():
        first = inj(ids).past_key_values
        inj(ids)  # a new sequence
        with pytest.raises(ValueError, match="earlier sequence"):
            inj(ids[:, :1], past_key_values=first)
    with pytest.raises(ValueError, match="tp_size=2 needs the tensor-parallel process group"):
        inject(tiny_model("gpt2"), SimpleNamespace(tensor_parallel=SimpleNamespace(tp_size=2)))
    with pytest.raises(NotImplementedError, match="dtype='int8'"):
        inject(tiny_model("gpt2"), SimpleNamespace(dtype="int8"))
    from transformers import OPTConfig, OPTForCausalLM
    opt = OPTForCausalLM(OPTConfig(hidden_size=16, num_attention_heads=2, ffn_dim=32, num_hidden_layers=1,
                                   vocab_size=50, word_embed_proj_dim=16))
    assert inject(opt, SimpleNamespace()) is None


def test_mixtral_through_init_inference_with_the_moe_section():
    _need_fused_experts()
    import copy

    import deepspeed_c

    ref = tiny_model("mixtral")
    ref.config._attn_implementation = "eager"
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    engine = deepspeed_c.init_inference(copy.deepcopy(ref), replace_with_kernel_inject=True, max_out_tokens=64,
                                        moe={"enabled": True, "ep_size": 1, "moe_experts": [5]})
    assert torch.equal(greedy(engine.module, ids, 12)[0], greedy(ref, ids, 12)[0])
    with pytest.raises(NotImplementedError, match="moe.ep_size=2 with replace_with_kernel_inject=True"):
        deepspeed_c.init_inference(copy.deepcopy(ref), replace_with_kernel_inject=True, moe={"ep_size": 2})
    with pytest.raises(ValueError, match="moe_experts says 4 experts"):
        deepspeed_c.init_inference(copy.deepcopy(ref), replace_with_kernel_inject=True, moe={"moe_experts": [4]})
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        engine.module(ids, output_router_logits=True)
