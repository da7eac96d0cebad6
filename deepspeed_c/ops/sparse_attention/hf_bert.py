"""BertSparseSelfAttention as a drop-in for Hugging Face's BertSelfAttention (transformers >= 4.48):
HF's BertAttention unpacks `(attention_output, attn_weights)` from its self-attention and hands
it the model's attention mask already expanded ([B, 1, L, L], additive float or bool "attend").
DeepSpeed's class returns one tensor and takes a key-padding mask, so the replacement helper
installs this subclass in HF models."""
from __future__ import annotations

from typing import Any

import torch

from .bert_sparse_self_attention import BertSparseSelfAttention


def key_padding_from_hf_mask(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """The additive [B, L] key-padding bias of an HF attention mask (one row of the expanded
    bidirectional mask: every query row of an encoder mask is the same)."""
    if mask is None:
        return None
    if mask.dim() == 4:
        mask = mask[:, 0, 0, :]
    elif mask.dim() == 3:
        mask = mask[:, 0, :]
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(f"attention_mask: expected HF's [batch, 1, seq, seq] or [batch, seq] mask, got "
                         f"{tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """Returns (context, None) and reads HF's expanded mask; everything else is BertSparseSelfAttention."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if kwargs.get("encoder_hidden_states") is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError("sparse self-attention takes no cross-attention or key/value cache")
        kpm = key_padding_from_hf_mask(attention_mask, hidden_states.shape[0])
        return super().forward(hidden_states, kpm), None
