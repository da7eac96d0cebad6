"""Block-sparsity layouts of DeepSpeed's sparse attention (`deepspeed.ops.sparse_attention`).

A layout is an int64 tensor [num_heads, num_blocks, num_blocks]: entry (h, r, c) is 1 when query
block r of head h attends to key block c. Each config builds it with `make_layout(seq_len)` and
matches DeepSpeed 0.19.6 element for element, including the random blocks: those are drawn from
Python's `random` module with the same calls in the same order, so one `random.seed` gives both
libraries the same layout (tests/unit/test_sparse_attn_layouts.py checks pinned fixtures)."""
from __future__ import annotations

import random
from typing import Sequence

import torch

_ATTENTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTIONS:
        # DeepSpeed raises NotImplementedError here; kept so code catching it still does.
        raise NotImplementedError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")
    return attention


def _check_global_windows(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_end_indices has {len(ends)} entries but global_block_indices has "
                         f"{len(starts)}; give one end per start")
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"global_block_indices entry {s} must be smaller than its global_block_end_indices "
                             f"entry {e}")


class SparsityConfig:
    """What every layout shares: heads, block size, and whether heads get their own layout."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout for `seq_len` tokens (a multiple of `block`)."""
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}! "
                             f"Pad the inputs with SparseAttentionUtils.pad_to_block_size first.")
        n = seq_len // self.block
        return torch.zeros((self.num_heads, n, n), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """With one layout for all heads, head 0's layout is copied to the others."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not define a layout; use one of its subclasses")


def _sliding_window(layout: torch.Tensor, h: int, window_blocks: int, causal: bool = False) -> None:
    n = layout.shape[1]
    if n < window_blocks:
        raise ValueError(f"Number of sliding window blocks, {window_blocks}, must be smaller than overall number "
                         f"of blocks in a row, {n}!")
    half = window_blocks // 2
    rows = torch.arange(n).unsqueeze(1)
    cols = torch.arange(n).unsqueeze(0)
    inside = (cols >= rows - half) & (cols <= (rows if causal else rows + half))
    layout[h][inside] = 1


def _local_windows(layout: torch.Tensor, h: int, window_of: list[int], causal: bool) -> None:
    """Local windows given as each block's window id (-1: in none): a block attends to the blocks of
    its own window (only those before it, and itself, when causal). One vectorised pass per head."""
    wid = torch.tensor(window_of, dtype=torch.int64)
    inside = (wid.unsqueeze(1) == wid.unsqueeze(0)) & (wid >= 0).unsqueeze(1)
    if causal:
        n = wid.numel()
        inside &= torch.arange(n).unsqueeze(0) <= torch.arange(n).unsqueeze(1)
    layout[h] |= inside.to(layout.dtype)  # blocks set before (random ones) stay set


def _random_blocks(layout: torch.Tensor, h: int, count: int, causal: bool) -> None:
    n = layout.shape[1]
    if n < count:
        raise ValueError(f"Number of random blocks, {count}, must be smaller than overall number of blocks in a "
                         f"row, {n}!")
    for row in range(n):  # one random.sample per row, in row order: the draws DeepSpeed makes
        layout[h, row, random.sample(range(row + 1) if causal else range(n), count)] = 1


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (for comparison with the sparse layouts)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout.fill_(1)
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's "fixed" pattern: local windows of `num_local_blocks`, and in each window
    `num_global_blocks` representative blocks that every query attends to (and, with
    `horizontal_global_attention`, that attend to everything). With `num_different_global_patterns`
    > 1 heads take different representatives (last blocks of the window first)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_global_blocks > num_local_blocks:
            raise ValueError(f"num_global_blocks ({num_global_blocks}) cannot exceed num_local_blocks "
                             f"({num_local_blocks}): the global blocks are chosen inside each local window")
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"Number of blocks in a local window, {num_local_blocks}, must be dividable by number "
                             f"of global blocks, {num_global_blocks}!")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True (one layout "
                             "for all heads has one global pattern)")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns ({num_different_global_patterns}) cannot be larger than "
                             f"num_local_blocks / num_global_blocks = {num_local_blocks // num_global_blocks}")
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        _local_windows(layout, h, [b // self.num_local_blocks for b in range(n)], self.attention == "unidirectional")
        return layout

    def _global_columns(self, h: int, layout: torch.Tensor, first: int, stop: int) -> None:
        top = 0 if self.attention == "bidirectional" else first
        layout[h, top:, first:stop] = 1
        if self.horizontal_global_attention:
            layout[h, first:stop, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        offset = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        full_windows_end = n - n % self.num_local_blocks
        for first in range(offset, full_windows_end, self.num_local_blocks):
            self._global_columns(h, layout, first, first + self.num_global_blocks)
        if full_windows_end < n:  # a short last window still gets its representatives, moved inside
            first = min(full_windows_end + offset, n - self.num_global_blocks)
            self._global_columns(h, layout, first, first + self.num_global_blocks)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """Fixed's generalisation: `num_random_blocks` random blocks per row, local windows whose sizes
    come from `local_window_blocks` (the last size repeats), and global blocks given by index
    (`global_block_indices`, or windows [start, end) with `global_block_end_indices`)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        if not self.local_window_blocks or min(self.local_window_blocks) < 1:
            raise ValueError(f"local_window_blocks must be a non-empty list of positive ints, got "
                             f"{local_window_blocks!r}")
        self.global_block_indices = list(global_block_indices)
        _check_global_windows(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _random_blocks(layout, h, self.num_random_blocks, causal=False)  # Variable draws from the whole row
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        sizes = self.local_window_blocks
        window_of: list[int] = []
        while len(window_of) < n:  # the listed windows, then the last size repeated
            w = len(window_of) and window_of[-1] + 1
            window_of += [w] * (sizes[w] if w < len(sizes) else sizes[-1])
        _local_windows(layout, h, window_of[:n], self.attention == "unidirectional")
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        ends = self.global_block_end_indices
        windows = [(s, s + 1) for s in self.global_block_indices] if ends is None else list(
            zip(self.global_block_indices, ends))
        for first, stop in windows:
            if first >= n:
                continue
            stop = min(stop, n)
            if self.horizontal_global_attention:
                layout[h, first:stop, :] = 1
            top = 0 if self.attention == "bidirectional" else first
            layout[h, top:, first:stop] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: `num_random_blocks` random blocks per row, a sliding window of
    `num_sliding_window_blocks`, and the first `num_global_blocks` blocks global both ways."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _random_blocks(layout, h, self.num_random_blocks, causal=self.attention == "unidirectional")
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_global_blocks:
            raise ValueError(f"Number of global blocks, {self.num_global_blocks}, must be smaller than overall "
                             f"number of blocks in a row, {n}!")
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window plus global blocks (by index or [start, end)
    windows) that attend to and are attended by every block."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.attention = attention
        _check_global_windows(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        ends = self.global_block_end_indices
        windows = [(s, s + 1) for s in self.global_block_indices] if ends is None else list(
            zip(self.global_block_indices, ends))
        for first, stop in windows:
            if first < n:
                layout[h, first:min(stop, n), :] = 1
                layout[h, :, first:min(stop, n)] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window of `num_sliding_window_blocks` only; causal by default."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional") -> None:
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, causal=self.attention != "bidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)
