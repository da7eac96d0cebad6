"""Token-level helpers of the hybrid-engine rollout: the pad id a tokenizer implies, response clean-up after an
EOS, the rollout's attention mask, and a nucleus sampler over last-position logits."""
from __future__ import annotations

from typing import Any

import torch


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad_token_id, else its eos_token_id (Hugging Face generate's fallback)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("The tokenizer must define pad_token_id or eos_token_id: rollouts right-pad responses "
                         "with it (set tokenizer.pad_token_id)")
    return pad


def pad_after_eos(output_ids: torch.Tensor, response_start: int, eos_token_id: Any,
                  pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps each response up to and including its first EOS and pads what follows; returns (ids, response
    attention [B, T_r] as long). An EOS counts as a real token even when it equals the pad id."""
    response = output_ids[:, response_start:]
    real = response != pad_token_id
    if eos_token_id is None or response.shape[1] == 0:
        return output_ids, real.long()
    eos = torch.as_tensor(eos_token_id, dtype=response.dtype, device=response.device).reshape(-1)
    is_eos = torch.isin(response, eos)
    # tokens strictly after the first EOS: the running count of EOS seen before each position is positive
    seen_before = is_eos.long().cumsum(dim=1) - is_eos.long()
    after = seen_before > 0
    first = is_eos & ~after
    output_ids = output_ids.clone()
    output_ids[:, response_start:] = response.masked_fill(after, pad_token_id)
    return output_ids, ((real | first) & ~after).long()


def rollout_attention(output_ids: torch.Tensor, prompt_attention: torch.Tensor,
                      response_attention: torch.Tensor) -> torch.Tensor:
    """The prompt columns take the request's mask (left padding 0), the response columns the EOS-aware mask."""
    prompt_len = prompt_attention.shape[1]
    mask = torch.empty_like(output_ids, dtype=torch.long)
    mask[:, :prompt_len] = prompt_attention.to(mask.device, torch.long)
    mask[:, prompt_len:] = response_attention
    return mask


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row [B, 1] from softmax(logits / temperature) restricted to the smallest set of most likely
    tokens whose mass reaches top_p (the most likely token always stays)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p, 0.0)
    sorted_probs[..., 0] = sorted_probs[..., 0].clamp_min(torch.finfo(sorted_probs.dtype).tiny)
    picked = torch.multinomial(sorted_probs / sorted_probs.sum(dim=-1, keepdim=True), 1)
    return order.gather(-1, picked)
