"""Tiny models for the compile / DeepCompile tests (importable by spawned ranks): a GPT with optional
activation checkpointing, a Hugging Face LLaMA, and a model with data-dependent control flow (a graph break)."""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, SEQ = 32, 8


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    def __init__(self, d: int = 32, layers: int = 2, heads: int = 2, checkpointing: Union[bool, str] = False,
                 branchy: bool = False) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, d)
        self.wpe = torch.nn.Embedding(SEQ, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)
        self.checkpointing = checkpointing
        self.branchy = branchy

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for i, blk in enumerate(self.blocks):
            if self.branchy and i == 1 and bool(x.float().mean() > 0):  # data-dependent: dynamo breaks the graph
                x = x * 0.5
            if self.checkpointing == "deepspeed":  # DeepSpeed's API (reentrant when not compiled)
                from deepspeed_c.runtime.activation_checkpointing.checkpointing import checkpoint as ds_checkpoint

                x = ds_checkpoint(blk, x)
            else:
                x = checkpoint(blk, x, use_reentrant=False) if self.checkpointing else blk(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), (labels if labels is not None else tokens).view(-1))


def tiny_llama(checkpointing: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class LlamaLoss(torch.nn.Module):
    """The LLaMA returning its loss as a tensor (the engine's callers take `loss = engine(batch)`)."""

    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        self.model = tiny_llama(checkpointing)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens, use_cache=False).loss


def make(kind: str, seed: int, checkpointing: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return TinyGPT(checkpointing=checkpointing)
    if kind == "gpt-dsckpt":
        return TinyGPT(checkpointing="deepspeed")
    if kind == "branchy":
        return TinyGPT(checkpointing=checkpointing, branchy=True)
    if kind == "llama":
        return LlamaLoss(checkpointing)
    raise ValueError(f"unknown model kind {kind!r}")


def batches(steps: int, micro_global: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (micro_global, SEQ), generator=g) for _ in range(steps)]
