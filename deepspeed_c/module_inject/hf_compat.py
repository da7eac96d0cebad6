"""What kernel injection reads from a Hugging Face LLaMA-family body, across transformers releases.

transformers 5.x (and 4.4x) keep one rotary module on the body (`body.rotary_emb`, with a
`rope_type`) and the softmax scale on each attention module (`self_attn.scaling`). transformers
4.3x (the releases whose model loops still pass legacy (key, value) tuples, which the real
DeepSpeed's injected layers need) keep a rotary module on each attention module, describe its
scaling in `config.rope_scaling = {"type": ..., "factor": ...}`, and divide by sqrt(head_dim)
without storing the scale. The injected blocks need the same two things from either, and take
HF's own numbers for them (its tables as its modules hold them), so they match HF eager."""
from __future__ import annotations

from typing import Any

import torch

_STATIC_ROPE = ("default", "linear", "llama3")


def attention_scale(attn: torch.nn.Module, head_dim: int) -> float:
    """The factor applied to q.k: the module's own `scaling` when it keeps one, else 1/sqrt(head_dim)."""
    scale = getattr(attn, "scaling", None)
    return float(head_dim ** -0.5 if scale is None else scale)


def rope_tables(body: torch.nn.Module, max_out: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin tables [max_out, head_dim] for positions 0..max_out-1, on the host: the values
    HF's own rotary module gives (after model.to(bf16) those are its bf16-rounded tables, as HF uses them)."""
    rot = getattr(body, "rotary_emb", None)
    if rot is not None:
        cos, sin = _model_level(rot, max_out, head_dim)
    else:
        cos, sin = _per_attention(body, max_out, head_dim)
    if cos.shape[-1] != head_dim:
        raise NotImplementedError(f"partial rotary (rotary dim {cos.shape[-1]} of head_dim {head_dim}) is not built")
    return cos.float().cpu().contiguous(), sin.float().cpu().contiguous()


def _model_level(rot: torch.nn.Module, max_out: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rope_type = getattr(rot, "rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        raise NotImplementedError(f"kernel injection with rope_type={rope_type!r} is not built (supported: "
                                  f"{list(_STATIC_ROPE)}: position tables that do not depend on the length)")
    dev = rot.inv_freq.device
    with torch.no_grad():
        probe = torch.zeros(1, 1, head_dim, dtype=torch.float32, device=dev)
        cos, sin = rot(probe, torch.arange(max_out, device=dev).unsqueeze(0))
    return cos[0], sin[0]


def static_rope_kind(cfg: Any) -> str:
    """transformers 4.3x: the rotary variant `config.rope_scaling` asks for, refused when its tables depend
    on the sequence length (the fused kernels take one table for every step)."""
    scaling = getattr(cfg, "rope_scaling", None) or {}
    kind = scaling.get("type", scaling.get("rope_type", "default")) if isinstance(scaling, dict) else "default"
    if kind not in ("default", "linear"):
        raise NotImplementedError(f"kernel injection with rope_scaling type {kind!r} is not built (supported: "
                                  "none and 'linear': position tables that do not depend on the length)")
    return kind


def _per_attention(body: torch.nn.Module, max_out: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 4.3x: every attention module holds the same rotary module, called as rot(x, seq_len=n)
    and returning [n, D] tables (4.33 and older: [1, 1, n, D])."""
    static_rope_kind(body.config)
    rot = body.layers[0].self_attn.rotary_emb
    with torch.no_grad():
        probe = torch.zeros(1, 1, head_dim, dtype=torch.float32, device=rot.inv_freq.device)
        cos, sin = rot(probe, seq_len=max_out)
    return cos.reshape(-1, cos.shape[-1])[:max_out], sin.reshape(-1, sin.shape[-1])[:max_out]


def route_beam_reorder(model: torch.nn.Module) -> None:
    """transformers 4.x beam search reorders the cache through the wrapper's `_reorder_cache(past, beam_idx)`,
    which rebuilds legacy tuples; for our cache handle it must reorder the fused cache in place instead.
    An instance attribute in front of the class's method: other caches still take the original."""
    original = getattr(model, "_reorder_cache", None)
    if original is None:
        return
    from deepspeed_c.module_inject.fused_decoder import InjectedCache

    def reorder(past: Any, beam_idx: torch.Tensor) -> Any:
        if isinstance(past, InjectedCache):
            past.reorder_cache(beam_idx)
            return past
        return original(past, beam_idx)

    model._reorder_cache = reorder
