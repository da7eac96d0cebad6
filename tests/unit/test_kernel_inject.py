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


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_mha", "mistral", "qwen2"])
def test_greedy_tokens_and_logits_equal_hf_eager(kind):
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
