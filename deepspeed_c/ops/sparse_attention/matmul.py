"""MatMul: DeepSpeed's block-sparse matrix product modules (SDD, DSD, DDS), in torch.

'sdd': dense a [B, H, M, K] x dense b [B, H, K, N] -> the layout's blocks of the product, [B, nnz, block, block]
'dsd': sparse a (the layout's blocks of an [M, K] matrix per head) x dense b [B, H, K, N] -> dense [B, H, M, N]
'dds': dense a [B, H, M, K] x sparse b (blocks of a [K, N] matrix per head) -> dense [B, H, M, N]
trans_a / trans_b transpose an operand first (a sparse operand's blocks and layout both). Only the
layout's blocks are computed (gathers of block rows/columns, batched matmuls, index_add), so cost
and memory follow the number of blocks; autograd gives the gradients. SparseSelfAttention does not
use these: it runs the fused kernels."""
from __future__ import annotations

import torch

from .block_format import BlockIndex

_MODES = ("sdd", "dsd", "dds")


class MatMul:
    """MatMul(layout, block, mode, trans_a=False, trans_b=False); call with (a, b)."""

    def __init__(self, layout: torch.Tensor, block: int, mode: str, trans_a: bool = False, trans_b: bool = False,
                 bench: bool = False) -> None:
        if mode not in _MODES:
            raise NotImplementedError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        self.layout = layout if layout.dim() == 3 else layout.unsqueeze(0)
        self.block = block
        self.mode = mode
        self.trans_a = trans_a
        self.trans_b = trans_b
        self._index: dict[str, BlockIndex] = {}
        self.spdims = self.layout.shape

    def _idx(self, device: torch.device) -> BlockIndex:
        key = str(device)
        if key not in self._index:
            self._index[key] = BlockIndex.of(self.layout, device)
        return self._index[key]

    @staticmethod
    def _4d(x: torch.Tensor, name: str) -> torch.Tensor:
        """Leading singleton dims up to 4 ([B, H, rows, cols] dense, [B, nnz, block, block] sparse)."""
        if x.dim() > 4:
            raise ValueError(f"argument {name!r}: at most 4 dims, got {x.dim()}")
        while x.dim() < 4:
            x = x.unsqueeze(0)
        return x

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.device != b.device:
            raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
        if a.dtype != b.dtype:
            raise TypeError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        dims = max(a.dim(), b.dim())
        a, b = self._4d(a, "a"), self._4d(b, "b")
        idx, blk = self._idx(a.device), self.block
        if self.mode == "sdd":
            if self.trans_a:
                a = a.transpose(-1, -2)
            if self.trans_b:
                b = b.transpose(-1, -2)
            ah = a.reshape(a.shape[0], a.shape[1], a.shape[2] // blk, blk, a.shape[3])  # [B, H, R, blk, K]
            bh = b.reshape(b.shape[0], b.shape[1], b.shape[2], b.shape[3] // blk, blk).transpose(2, 3)  # [B, H, C, K, blk]
            rows = ah[:, idx.head if a.shape[1] > 1 else 0 * idx.head, idx.row]  # [B, nnz, blk, K]
            cols = bh[:, idx.head if b.shape[1] > 1 else 0 * idx.head, idx.col]  # [B, nnz, K, blk]
            out = torch.matmul(rows, cols)
        elif self.mode == "dsd":
            out = self._sparse_times_dense(a, b, idx)
        else:  # dds: (a S)^T = S^T a^T
            out = self._sparse_times_dense(b, a.transpose(-1, -2), idx, flip=True).transpose(-1, -2)
        while out.dim() > dims:
            out = out.squeeze(0)
        return out

    def _sparse_times_dense(self, s: torch.Tensor, d: torch.Tensor, idx: BlockIndex, flip: bool = False) -> torch.Tensor:
        """op(S) @ d for a sparse S [B, nnz, blk, blk] (layout [H, R, C] as stored) and dense d [B, H, K, N];
        op(S) = S^T when the sparse operand is transposed (trans_a for dsd; for dds, where the call
        computes S^T a^T, when trans_b is *not* set)."""
        blk = self.block
        transposed = self.trans_a if not flip else not self.trans_b
        if not flip and self.trans_b:
            d = d.transpose(-1, -2)
        if flip and self.trans_a:
            d = d.transpose(-1, -2)
        blocks = s.transpose(-1, -2) if transposed else s
        out_rows, in_cols = (idx.col, idx.row) if transposed else (idx.row, idx.col)
        out_count = idx.cols if transposed else idx.rows
        H = idx.heads
        B, Hd, K, N = d.shape
        if K != (idx.rows if transposed else idx.cols) * blk:
            raise ValueError(f"the dense operand's inner size must be {(idx.rows if transposed else idx.cols) * blk}, "
                             f"got {K}")
        dh = d.reshape(B, Hd, K // blk, blk, N)
        pieces = dh[:, idx.head if Hd > 1 else 0 * idx.head, in_cols]  # [B, nnz, blk, N]
        prod = torch.matmul(blocks, pieces)  # [B', nnz, blk, N]
        Bo = prod.shape[0]
        out = prod.new_zeros(Bo, H * out_count, blk, N)
        out = out.index_add(1, idx.head * out_count + out_rows, prod)
        return out.reshape(Bo, H, out_count * blk, N)
