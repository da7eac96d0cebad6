"""The models benchmarks/parallel_throughput.py trains, all from the GPT family of
examples/train_gpt/model.py (the data-parallel benchmark's), each built under explicit seeds so that
deepspeed_c and the real DeepSpeed start from the same weights:

- pipeline layers (embedding, blocks, final norm + head) for PipelineModule's LayerSpecs, every layer
  seeded by its own index (the libraries build the layers on different ranks and in different orders);
- a GPT whose block MLPs are a library's MoE layer (the caller loads one model's state_dict into the
  other's);
- a LLaMA-style transformers model from a config (no download) for AutoTP;
- a GPT block stack whose attention core is a library's Ulysses DistributedAttention.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))

from model import Block, CausalSelfAttention, GPTConfig  # noqa: E402


def _seeded(seed: int) -> Any:
    """A CPU RNG context with `seed`: layer init draws from it and leaves the global stream alone."""
    ctx = torch.random.fork_rng(devices=[])
    ctx.__enter__()
    torch.manual_seed(seed)
    return ctx


# -- pipeline layers -------------------------------------------------------------------------------

class PipeEmbed(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        super().__init__()
        ctx = _seeded(seed)
        try:
            self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        finally:
            ctx.__exit__(None, None, None)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class PipeBlock(Block):
    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        ctx = _seeded(seed)
        try:
            super().__init__(cfg)
        finally:
            ctx.__exit__(None, None, None)


class PipeHead(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        super().__init__()
        ctx = _seeded(seed)
        try:
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        finally:
            ctx.__exit__(None, None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def pipe_specs(lib: Any, cfg: GPTConfig) -> list:
    """LayerSpecs of `lib` (deepspeed_c.pipe or deepspeed.pipe): embed, n_layer blocks, head."""
    specs = [lib.LayerSpec(PipeEmbed, cfg, 0)]
    specs += [lib.LayerSpec(PipeBlock, cfg, 1 + i) for i in range(cfg.n_layer)]
    return specs + [lib.LayerSpec(PipeHead, cfg, 1 + cfg.n_layer)]


# -- MoE GPT ---------------------------------------------------------------------------------------

class MoEBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, moe_cls: type, experts: int, ep: int, k: int, cf: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        expert = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        # deterministic routing: no random token selection, no sampled second expert (both libraries
        # draw those from their own RNG streams, which would make the loss check meaningless)
        self.moe = moe_cls(cfg.n_embd, expert=expert, num_experts=experts, ep_size=ep, k=k, capacity_factor=cf,
                           eval_capacity_factor=cf, min_capacity=4, use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        out, aux, _ = self.moe(self.ln2(x))
        return x + out, aux


class MoEGPT(nn.Module):
    """forward(idx, targets) -> cross-entropy + 0.01 x the gates' load-balancing loss."""

    def __init__(self, cfg: GPTConfig, moe_cls: type, experts: int, ep: int, k: int, cf: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(MoEBlock(cfg, moe_cls, experts, ep, k, cf) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a.float()
        return lm_loss(self.head(self.ln_f(x)), targets) + 0.01 * aux


def expert_param_count(model: nn.Module) -> tuple[int, int]:
    """(parameters outside the experts, parameters of one local expert summed over the layers)."""
    shared, one = 0, 0
    for name, p in model.named_parameters():
        if ".deepspeed_experts." in name:
            if ".deepspeed_experts.0." in name:
                one += p.numel()
        else:
            shared += p.numel()
    return shared, one


# -- LLaMA for AutoTP --------------------------------------------------------------------------------

def llama(width: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=width, intermediate_size=int(8 * width / 3 + 255) // 256 * 256,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    ctx = _seeded(seed)
    try:
        return LlamaForCausalLM(cfg)
    finally:
        ctx.__exit__(None, None, None)


# -- Ulysses GPT blocks ------------------------------------------------------------------------------

def causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
    """Attention on [b, s, h, d] (the layout Ulysses hands the local attention), causal."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2)


class UlyssesBlock(nn.Module):
    """The GPT block with its attention core wrapped by `dist_attn_cls` (None: plain local attention
    over the whole sequence, the reference)."""

    def __init__(self, cfg: GPTConfig, dist_attn_cls: type | None, group: Any) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        # [b, s, h, d] (batch_dim_idx 0): heads scattered, the sequence gathered
        self.dist = None if dist_attn_cls is None else dist_attn_cls(causal_core, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.reshape(b, t, self.n_head, c // self.n_head) for z in (q, k, v))
        y = causal_core(q, k, v) if self.dist is None else self.dist(q, k, v, 0)
        x = x + self.proj(y.reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


def ulysses_stack(cfg: GPTConfig, dist_attn_cls: type | None, group: Any, seed: int = 0) -> nn.Module:
    ctx = _seeded(seed)
    try:
        return nn.Sequential(*(UlyssesBlock(cfg, dist_attn_cls, group) for _ in range(cfg.n_layer)))
    finally:
        ctx.__exit__(None, None, None)
