"""Small GPT models shared by the flops profiler's tests (tests/unit/flops_profiler_models.py, which
works out their analytic counts), benchmarks/profiler_overhead.py and the autotuning benchmark's
training script: one definition, so the model the tests count is the model the benchmarks time."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GPTBlock(nn.Module):
    """Pre-LN causal block: fused qkv, scaled_dot_product_attention, 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `layers` GPTBlocks, final LayerNorm, untied LM head. With
    `checkpoint_activations` each block runs under deepspeed_c.checkpointing.checkpoint (its
    activations recomputed in backward), the switch the autotuning benchmark tunes."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int,
                 checkpoint_activations: bool = False) -> None:
        super().__init__()
        self.checkpoint_activations = checkpoint_activations
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                from deepspeed_c.runtime.activation_checkpointing.checkpointing import checkpoint

                x = checkpoint(blk, x)
            else:
                x = blk(x)
        return self.head(self.ln(x))
