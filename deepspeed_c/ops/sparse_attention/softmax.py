"""Softmax: DeepSpeed's block-sparse softmax module, in torch. x [B, nnz, block, block] holds the
layout's blocks of a score matrix; each row is normalised over the nonzero blocks of its block
row, after scale, relative position embedding and masks (modes as SparseSelfAttention's)."""
from __future__ import annotations

import torch

from .block_format import BlockIndex, dense_blocks


class Softmax:
    """Softmax(layout, block); call with (x, scale=1., rpe=None, key_padding_mask=None, attn_mask=None,
    key_padding_mask_mode='add', attn_mask_mode='add')."""

    def __init__(self, layout: torch.Tensor, block: int, bench: bool = False) -> None:
        self.layout = layout if layout.dim() == 3 else layout.unsqueeze(0)
        self.block = block
        self.spdims = self.layout.shape
        self._index: dict[str, BlockIndex] = {}

    def _idx(self, device: torch.device) -> BlockIndex:
        key = str(device)
        if key not in self._index:
            self._index[key] = BlockIndex.of(self.layout, device)
        return self._index[key]

    @staticmethod
    def _additive(mask: torch.Tensor, mode: str, name: str) -> torch.Tensor:
        if mode not in ("add", "mul"):
            raise ValueError(f"{name}_mode must be 'add' or 'mul', got {mode!r}")
        mask = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
        return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf")) if mode == "mul" else mask

    def __call__(self, x: torch.Tensor, scale: float = 1.0, rpe: torch.Tensor | None = None,
                 key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                 key_padding_mask_mode: str = "add", attn_mask_mode: str = "add") -> torch.Tensor:
        idx, blk = self._idx(x.device), self.block
        if x.dim() != 4 or x.shape[1:] != (idx.nnz, blk, blk):
            raise ValueError(f"x must be [batch, {idx.nnz}, {blk}, {blk}] (the layout's blocks), got {tuple(x.shape)}")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        s = x.to(work) * scale
        if rpe is not None:
            if rpe.dtype != x.dtype:
                raise TypeError(f"rpe must have x's dtype {x.dtype}, got {rpe.dtype}")
            r = rpe.reshape(-1, *rpe.shape[-3:]) if rpe.dim() >= 3 else rpe.reshape(1, 1, *rpe.shape)
            s = s + dense_blocks(r.to(work), blk, idx.head, idx.row, idx.col)
        if key_padding_mask is not None:
            kpm = self._additive(key_padding_mask.reshape(x.shape[0], -1), key_padding_mask_mode, "key_padding_mask")
            cols = kpm.to(work).reshape(x.shape[0], -1, blk)[:, idx.col]  # [B, nnz, blk]
            s = s + cols[:, :, None, :]
        if attn_mask is not None:
            am = self._additive(attn_mask.squeeze(), attn_mask_mode, "attn_mask").to(work)
            s = s + dense_blocks(am[None, None], blk, idx.head, idx.row, idx.col)
        # the max of each row over its block row's blocks, then exp and the matching sums
        groups = idx.heads * idx.rows
        row_max = s.new_full((s.shape[0], groups, blk), float("-inf"))
        row_max = row_max.scatter_reduce(1, idx.row_group.view(1, -1, 1).expand(s.shape[0], -1, blk),
                                         s.detach().amax(-1), reduce="amax")
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        e = torch.exp(s - row_max[:, idx.row_group].unsqueeze(-1))
        sums = e.new_zeros(s.shape[0], groups, blk).index_add(1, idx.row_group, e.sum(-1))
        out = e / sums[:, idx.row_group].unsqueeze(-1).clamp_min(torch.finfo(work).tiny)
        return out.to(x.dtype)
