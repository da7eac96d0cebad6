"""BertSparseSelfAttention: a BERT self-attention layer whose attention is SparseSelfAttention."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import FixedSparsityConfig, SparsityConfig


class BertSparseSelfAttention(nn.Module):
    """query/key/value projections of `config.hidden_size` into `config.num_attention_heads` heads,
    block-sparse attention, and the heads merged back to [B, L, hidden]."""

    def __init__(self, config: Any, sparsity_config: SparsityConfig = FixedSparsityConfig(num_heads=4)) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({config.num_attention_heads})")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        # DeepSpeed built the layout for 2048 tokens whatever the model; the model's own length (set by
        # replace_model_self_attention_with_sparse_self_attention) lets the tutorial's 4096-token flow run
        max_len = max(2048, int(getattr(config, "max_position_embeddings", 2048) or 2048))
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_len)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *args: Any, **kwargs: Any) -> Any:
        """attention_mask: the additive key-padding mask (BERT's extended mask [B, 1, 1, L] or [B, L])."""
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        ctx = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        ctx = ctx.permute(0, 2, 1, 3).contiguous()
        return ctx.view(*ctx.shape[:-2], self.all_head_size)
