"""The dense masked form of block-sparse attention: the CPU path, and the reference the CUDA
kernels are tested against. Scores over the whole L x L square, blocks outside the layout set to
-inf before the softmax; a row with nothing left attends to nothing (its output is zero, where
DeepSpeed's Triton softmax gave NaN)."""
from __future__ import annotations

import torch


def token_mask(layout: torch.Tensor, block: int) -> torch.Tensor:
    """bool [H, L, L]: the layout [H, nb, nb] widened from blocks to tokens."""
    return layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def dense_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int,
                           scale: float, kpm: torch.Tensor | None = None, am: torch.Tensor | None = None,
                           rpe: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale q k^T + rpe + kpm + am, restricted to the layout) v over [B, H, L, D].
    kpm [B, L], am [L, L] and rpe (broadcastable to [B, H, L, L]) are additive float biases.
    Math in float32 (float64 stays float64); the result has q's dtype. Differentiable in q, k, v."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    if rpe is not None:
        s = s + rpe.to(work)
    if kpm is not None:
        s = s + kpm.to(work)[:, None, None, :]
    if am is not None:
        s = s + am.to(work)
    s = s.masked_fill(~token_mask(layout, block).to(s.device), float("-inf"))
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.matmul(p, v.to(work)).to(q.dtype)
