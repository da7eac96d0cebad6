"""Tiny Hugging Face decoders (built from configs, no downloads) and the single-process reference
training the AutoTP tests compare against."""
from __future__ import annotations

import numpy as np
import torch

VOCAB = 64


def make_model(kind: str, seed: int = 0, kv_heads: int = 2) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=kv_heads,
                                       max_position_embeddings=32, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        model = _other(kind, transformers)
    return model


def _other(kind: str, transformers) -> torch.nn.Module:
    """Forward-only architectures: OPT (fc1/fc2, out_proj), BLOOM (per-head fused query_key_value, ALiBi),
    Qwen2 and Mistral (GQA), Phi-3 (concatenated qkv_proj and gate_up_proj)."""
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)
    llama_like = dict(small, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32)
    if kind == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(**small, ffn_dim=64, num_attention_heads=4,
                                                                  max_position_embeddings=32, word_embed_proj_dim=32))
    if kind == "bloom":
        return transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2,
                                                                      n_head=4))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**llama_like))
    if kind == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**llama_like, pad_token_id=0))
    raise ValueError(kind)


def batches(steps: int, rows: int, seed: int = 1, seq: int = 8) -> list[torch.Tensor]:
    """Two fixed batches in turn: a tiny model visibly learns them in a few steps."""
    g = torch.Generator().manual_seed(seed)
    two = [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(2)]
    return [two[i % 2] for i in range(steps)]


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference_training(kind: str, data: list[torch.Tensor], lr: float, eps: float,
                       clip: float = 0.0) -> tuple[list[float], dict, list[float]]:
    """One process, the whole global batch each step, torch.optim.Adam (after clip_grad_norm_ when clip > 0):
    (losses, final state dict, gradient norms)."""
    model = make_model(kind)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
    losses, norms = [], []
    for ids in data:
        loss = loss_of(model, ids)
        loss.backward()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, norms


def full_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The sharded model's state with every tensor-parallel weight gathered (collective on the TP group)."""
    import deepspeed_c

    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3: the shards whole from their partitions
        with deepspeed_c.zero.GatheredParameters(list(model.parameters())):
            return _full_state(model)
    return _full_state(model)


def _full_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    from deepspeed_c.module_inject.layers import TensorParallel_Layer

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, TensorParallel_Layer):
            for key, value in module.full_state().items():
                state[f"{name}.{key}"] = value
    return {k: (v.float() if v.is_floating_point() else v).cpu().numpy() for k, v in state.items()}
