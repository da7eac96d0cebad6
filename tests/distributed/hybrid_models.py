"""Tiny Hugging Face causal LMs (random weights, built from configs) and a DeepSpeed-Chat style LoRA linear
for the hybrid-engine tests and the RLHF example's tests."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

VOCAB = 97


class LoRALinear(torch.nn.Module):
    """DeepSpeed-Chat's LinearLayer_LoRA: y = x W^T + b + scaling * (x @ right @ left). The hybrid engine's
    `fuse_lora_weight` folds the update into W in place (`+=`) and `unfuse_lora_weight` takes it out."""

    def __init__(self, linear: torch.nn.Linear, lora_dim: int = 4, lora_scaling: float = 0.5) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lora_right_weight = torch.nn.Parameter(torch.empty(linear.in_features, lora_dim))
        self.lora_left_weight = torch.nn.Parameter(torch.empty(lora_dim, linear.out_features))
        self.lora_scaling = lora_scaling / lora_dim
        torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        # DeepSpeed-Chat starts the left factor at zero; random here so the update counts from the first token
        torch.nn.init.normal_(self.lora_left_weight, std=0.2)
        self.fuse_lora = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return out
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def convert_to_lora(model: torch.nn.Module, part: str = "layers.") -> torch.nn.Module:
    """Every nn.Linear whose name contains `part` becomes a LoRALinear (DeepSpeed-Chat's
    convert_linear_layer_to_lora)."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and part in n]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, leaf, LoRALinear(getattr(holder, leaf)))
    return model


def tiny_lm(kind: str, seed: int = 0, lora: bool = False, layers: int = 2) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":  # GQA 2:1, head_dim 8
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                   intermediate_size=48, num_hidden_layers=layers,
                                                   max_position_embeddings=128, **common))
    elif kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_head=4, n_layer=layers, n_positions=128,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common))
    elif kind == "opt":  # no fused blocks in deepspeed_c: the hybrid engine falls back to HF generate
        model = tf.OPTForCausalLM(tf.OPTConfig(hidden_size=32, num_attention_heads=4, ffn_dim=48,
                                               num_hidden_layers=layers, word_embed_proj_dim=32, dropout=0.0,
                                               attention_dropout=0.0, max_position_embeddings=128, **common))
    else:
        raise ValueError(kind)
    if lora:
        convert_to_lora(model)
    return model


def prompts(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
