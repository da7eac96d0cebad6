"""Tiny HF decoders (random weights, built from configs) for the kernel-injection tests: GPT-2
and the LLaMA family with odd head counts, GQA ratios 1, 3 and 5, q/k/v biases (Qwen2).
Written to run under transformers 4.35 too (no Qwen2 there; `generate` has no output_logits)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

VOCAB = 101


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=60, n_head=5, n_layer=2, n_positions=256, **common))
    elif kind == "llama":  # 5 query heads over 1 kv head (GQA ratio 5), head_dim 12
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=60, num_attention_heads=5, num_key_value_heads=1,
                                             intermediate_size=88, num_hidden_layers=2, **common))
    elif kind == "llama_mha":  # as many kv heads as query heads (the real DeepSpeed's LLaMA container needs it)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                                                   intermediate_size=80, num_hidden_layers=2, **common))
    elif kind == "llama_wide":  # head_dim 128 (the common LLaMA width), GQA 2:1
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=640, num_hidden_layers=2, **common))
    elif kind == "mistral":  # 6 heads over 2 kv heads (ratio 3); the window wider than the cache
        model = tf.MistralForCausalLM(tf.MistralConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                                 intermediate_size=72, num_hidden_layers=2, sliding_window=512,
                                                 **common))
    elif kind == "qwen2":  # q/k/v biases, 3 heads, no GQA
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(hidden_size=36, num_attention_heads=3, num_key_value_heads=3,
                                             intermediate_size=50, num_hidden_layers=2, **common))
        with torch.no_grad():  # HF zero-initialises biases; make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.2)
    elif kind == "mixtral":  # 5 experts, top 2; 4 heads over 2 kv heads
        model = tf.MixtralForCausalLM(tf.MixtralConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                                       intermediate_size=40, num_hidden_layers=2, num_local_experts=5,
                                                       num_experts_per_tok=2, **common))
    else:
        raise ValueError(kind)
    return model.eval()


def injected_pair(kind: str, max_out_tokens: int = 128, **cfg) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF eager model, kernel-injected copy of it)."""
    from deepspeed_c.module_inject.kernel_inject import inject
    ref = tiny_model(kind)
    ref.config._attn_implementation = "eager"
    injected = inject(copy.deepcopy(ref), SimpleNamespace(max_out_tokens=max_out_tokens, **cfg))
    assert injected is not None
    return ref, injected


def greedy(model: torch.nn.Module, ids: torch.Tensor, new: int, mask: torch.Tensor | None = None):
    """(sequences, logits [B, new, V]); under transformers < 4.38 the logits are generate's scores (the
    same logits with min_new_tokens' -inf at eos, applied alike to both models compared)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    which = "logits" if (major, minor) >= (4, 38) else "scores"
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0, **{f"output_{which}": True})
    return out.sequences, torch.stack(getattr(out, which), dim=1)
