"""Load balancing of the block-sparse kernels' grid (issue 45).

One CTA walks one layout block row (forward, dQ) or column (dK/dV). Global blocks make a few rows
(columns) dense: their CTA walks ~nb blocks while the rest walk ~density * nb, so the grid ends
with a tail of a few long CTAs. A `WorkPlan` splits every row longer than `factor` x the mean into
parts of about the mean (each part a contiguous range of the row's blocks, one CTA each, writing
float32 partial results to a scratch slot), lists all CTAs longest first so the long ones start
first, and lists the split rows for a combine kernel that merges their parts (the forward by
log-sum-exp weights, dQ/dK/dV by summing). Rows under the threshold keep the direct path.

Item rows (int32 x 4): (head * nb + row, lo, hi, slot): the row's blocks [lo, hi) of its CSR
range, slot -1 to write the result directly, else the scratch slot of this part.
Merge rows (int32 x 4): (head * nb + row, first slot, parts, 0).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

BALANCE_ENV = "DSC_SPARSE_ATTN_BALANCE"
DEFAULT_FACTOR = 2.0


def balance_enabled() -> bool:
    """The balanced grid is on unless `DSC_SPARSE_ATTN_BALANCE=0` (H200, 16k tokens: BigBird fwd+bwd 4.72 -> 3.56 ms,
    Fixed 4.26 -> 3.92; the split parts' float32 scratch is the cost, e.g. 34 -> 106 MB peak for Fixed's dK/dV);
    read when a SparseSelfAttention first builds its block tables for a sequence length (they are cached)."""
    value = os.environ.get(BALANCE_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"environment variable {BALANCE_ENV} must be 0 or 1, got {value!r}")
    return value != "0"


@dataclass(frozen=True)
class WorkPlan:
    items: torch.Tensor  # [n_items, 4] int32
    merges: torch.Tensor  # [n_merges, 4] int32
    slots: int

    def to(self, device: torch.device | str) -> "WorkPlan":
        return WorkPlan(self.items.to(device), self.merges.to(device), self.slots)

    @staticmethod
    def build(ptr: torch.Tensor, factor: float = DEFAULT_FACTOR, part: int | None = None) -> "WorkPlan":
        """The plan of a CSR pointer array [n_rows + 1] (row_ptr or col_ptr). Rows with more than
        `factor` x the mean blocks (and at least 2) split into parts of about `part` blocks (default:
        the mean, rounded up)."""
        if factor <= 0:
            raise ValueError(f"argument 'factor' must be > 0, got {factor}")
        if part is not None and part < 1:
            raise ValueError(f"argument 'part' must be >= 1, got {part}")
        ptr = ptr.detach().to("cpu", torch.int64)
        counts = ptr[1:] - ptr[:-1]
        n_rows = counts.numel()
        mean = float(counts.sum()) / max(n_rows, 1)
        target = part if part is not None else max(1, math.ceil(mean))
        items: list[tuple[int, int, int, int]] = []
        merges: list[tuple[int, int, int, int]] = []
        slots = 0
        for r, n in enumerate(counts.tolist()):
            lo = int(ptr[r])
            if n < 2 or n <= factor * mean:
                items.append((r, lo, lo + n, -1))
                continue
            parts = min(n, math.ceil(n / target))
            if parts < 2:
                items.append((r, lo, lo + n, -1))
                continue
            merges.append((r, slots, parts, 0))
            for p in range(parts):  # near-equal contiguous ranges
                items.append((r, lo + n * p // parts, lo + n * (p + 1) // parts, slots + p))
            slots += parts
        table = torch.tensor(items, dtype=torch.int64).reshape(-1, 4)
        order = torch.sort(table[:, 2] - table[:, 1], descending=True, stable=True).indices
        return WorkPlan(table[order].to(torch.int32).contiguous(),
                        torch.tensor(merges, dtype=torch.int32).reshape(-1, 4), slots)
