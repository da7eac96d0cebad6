"""DeepSpeed's block-sparse tensor format and the index tables over it.

A block-sparse tensor for a layout [H, R, C] is [B, nnz, block, block]: the nonzero blocks of the
layout in (head, block row, block column) order. `BlockIndex` holds, per nonzero block, its head,
block row and block column, and the id of its (head, row) and (head, column) groups, which the
matmul and softmax modules gather and reduce by."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockIndex:
    head: torch.Tensor  # [nnz] int64
    row: torch.Tensor
    col: torch.Tensor
    row_group: torch.Tensor  # head * R + row
    col_group: torch.Tensor  # head * C + col
    heads: int
    rows: int
    cols: int

    @staticmethod
    def of(layout: torch.Tensor, device: torch.device | str) -> "BlockIndex":
        if layout.dim() == 2:
            layout = layout.unsqueeze(0)
        if layout.dim() != 3:
            raise ValueError(f"layout must be [heads, block rows, block cols] (or 2D), got shape {tuple(layout.shape)}")
        H, R, C = layout.shape
        nz = layout.detach().cpu().bool().nonzero().to(device)
        h, r, c = nz[:, 0], nz[:, 1], nz[:, 2]
        return BlockIndex(h, r, c, h * R + r, h * C + c, H, R, C)

    @property
    def nnz(self) -> int:
        return int(self.head.numel())


def dense_blocks(x: torch.Tensor, block: int, heads: torch.Tensor, rows: torch.Tensor,
                 cols: torch.Tensor) -> torch.Tensor:
    """Blocks (heads[i], rows[i], cols[i]) of a dense [B, H or 1, M, N] tensor: [B, nnz, block, block]."""
    B, Hx, M, N = x.shape
    tiles = x.reshape(B, Hx, M // block, block, N // block, block).transpose(3, 4)
    return tiles[:, heads if Hx > 1 else torch.zeros_like(heads), rows, cols]
