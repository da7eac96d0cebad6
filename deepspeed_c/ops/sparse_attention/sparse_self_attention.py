"""SparseSelfAttention: DeepSpeed's block-sparse self-attention module over [B, H, L, D] tensors.

The layout comes from a SparsityConfig, built once for `max_seq_length` (`master_layout`, a
buffer) and cut to each call's length. fp16/bf16 CUDA tensors run the fused block-sparse
kernels (kernel.py); anything else (CPU, float32, head dims the kernels do not take) runs the
dense masked path (reference.py), which gives the same result with L x L memory."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .kernel import BlockTables, kernel_supports, sparse_attention_cuda
from .reference import dense_sparse_attention
from .sparsity_config import SparsityConfig

_MASK_MODES = ("add", "mul")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """A mask as an additive float bias (float64 stays float64, else float32): 'add' as given, 'mul'
    zeros to -inf and the rest to 0."""
    mask = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    if mode == "mul":
        return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf"))
    return mask


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention (Sparse Transformers, https://arxiv.org/abs/1904.10509).

    Arguments:
        sparsity_config: the layout's SparsityConfig (its num_heads must equal the query's heads).
        key_padding_mask_mode: 'add' (the mask is added to the scores) or 'mul' (zeros are masked out).
        attn_mask_mode: the same for attn_mask.
        max_seq_length: the longest sequence this module will see; the master layout's size.
    """

    def __init__(self, sparsity_config: SparsityConfig = SparsityConfig(num_heads=4), key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048) -> None:
        super().__init__()
        if key_padding_mask_mode not in _MASK_MODES:
            raise ValueError(f"key_padding_mask_mode must be 'add' or 'mul', got {key_padding_mask_mode!r}")
        if attn_mask_mode not in _MASK_MODES:
            raise ValueError(f"attn_mask_mode must be 'add' or 'mul', got {attn_mask_mode!r}")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self._tables: dict[tuple[int, str], BlockTables] = {}

    def get_layout(self, L: int) -> torch.Tensor:
        """The layout of an L-token sequence [H, L/block, L/block] (CPU). Random layouts differ per
        rank, so the first call in a process group takes rank 0's (as DeepSpeed does)."""
        if self._need_layout_synchronization and dist.is_available() and dist.is_initialized():
            dist.broadcast(self.master_layout, src=0)
            self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(f"Sequence Length, {L}, needs to be dividable by Block size {block}! Pad the inputs "
                             f"with SparseAttentionUtils.pad_to_block_size.")
        n = L // block
        if n > self.master_layout.shape[-1]:
            raise ValueError(f"sequence length {L} is longer than max_seq_length "
                             f"{self.master_layout.shape[-1] * block} this SparseSelfAttention was built for")
        return self.master_layout[..., :n, :n].cpu()

    def _block_tables(self, L: int, device: torch.device) -> BlockTables:
        key = (L, str(device))
        if key not in self._tables:
            self._tables[key] = BlockTables.from_layout(self.get_layout(L), device)
        return self._tables[key]

    def transpose_key_for_scores(self, x: torch.Tensor, L: int) -> torch.Tensor:
        """A key given as [B, H, D, L] is turned back to [B, H, L, D]."""
        return x.permute(0, 1, 3, 2) if x.size(2) != L else x

    @staticmethod
    def transpose_mask_for_sparse(qtype: torch.dtype, x: torch.Tensor, is_key_padding_mask: bool = False):
        """DeepSpeed's mask squeeze: a key-padding mask loses every size-1 dim but the batch, an
        attention mask every size-1 dim."""
        x = x.to(qtype)
        if is_key_padding_mask:
            for d in range(x.dim() - 1, 0, -1):
                x = x.squeeze(dim=d)
            return x
        return x.squeeze()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of [B, H, L, D] query/key/value (key may be [B, H, D, L]).

        rpe: an additive relative-position bias broadcastable to [B, H, L, L].
        key_padding_mask: [B, L] (or [B, 1, 1, L]), per key_padding_mask_mode.
        attn_mask: [L, L], per attn_mask_mode."""
        if query.dtype not in _FLOATS:
            raise TypeError(f"query must be a floating tensor (float16, bfloat16, float32 or float64), got "
                            f"{query.dtype}")
        if query.dim() != 4:
            raise ValueError(f"query must be [batch, heads, seq, head_dim], got shape {tuple(query.shape)}")
        bsz, num_heads, L, head_dim = query.shape
        key = self.transpose_key_for_scores(key, L)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError(f"only self-attention is supported: query {tuple(query.shape)}, key "
                                      f"{tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
        for name, t in (("key", key), ("value", value)):
            if t.dtype != query.dtype:
                raise TypeError(f"{name} must have the query's dtype {query.dtype}, got {t.dtype}")
        if num_heads != self.sparsity_config.num_heads:
            raise ValueError(f"the layout has {self.sparsity_config.num_heads} heads (sparsity_config.num_heads) but "
                             f"the query has {num_heads}")
        kpm = am = None
        # masks stay float32 (float64 with float64 queries): DeepSpeed rounded them to the query's fp16
        mask_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        if key_padding_mask is not None:
            kpm = self.transpose_mask_for_sparse(mask_dtype, key_padding_mask, is_key_padding_mask=True)
            if kpm.dim() == 1 and bsz == 1:
                kpm = kpm.unsqueeze(0)
            if tuple(kpm.shape) != (bsz, L):
                raise ValueError(f"key_padding_mask must be [batch, seq] = [{bsz}, {L}] (size-1 dims allowed), "
                                 f"got {tuple(key_padding_mask.shape)}")
            kpm = _additive(kpm, self.key_padding_mask_mode).contiguous()
        if attn_mask is not None:
            am = self.transpose_mask_for_sparse(mask_dtype, attn_mask)
            if tuple(am.shape) != (L, L):
                raise ValueError(f"attn_mask must be [seq, seq] = [{L}, {L}], got {tuple(attn_mask.shape)}")
            am = _additive(am, self.attn_mask_mode).contiguous()
        if rpe is not None:
            rpe = rpe.detach()
            while rpe.dim() < 4:
                rpe = rpe.unsqueeze(0)
            if rpe.dim() != 4 or rpe.shape[-2:] != (L, L) or rpe.shape[0] not in (1, bsz) or rpe.shape[1] not in (
                    1, num_heads):
                raise ValueError(f"rpe must broadcast to [batch, heads, seq, seq] = [{bsz}, {num_heads}, {L}, {L}], "
                                 f"got {tuple(rpe.shape)}")
        scale = float(head_dim) ** -0.5
        block = self.sparsity_config.block
        if kernel_supports(query, block):
            tables = self._block_tables(L, query.device)
            f32 = [None if t is None else t.float().contiguous() for t in (kpm, am, rpe)]
            return sparse_attention_cuda(query, key, value, tables, block, scale, *f32)
        return dense_sparse_attention(query, key, value, self.get_layout(L), block, scale, kpm, am, rpe)
