"""Which elements of a flat ZeRO partition ZenFlow's selected columns are, and moving them between the
partition and a packed list, on the host through the C core (csrc/cpu/columns.c) or, anywhere, through the
reference here (torch indexing), which the tests hold the C core to.

A matrix parameter [rows, cols] (row-major; more dimensions are folded into rows) has its columns ranked;
the partition holds slices of it, possibly cut mid-row. One segment per (matrix, slice): see dsc/columns.h.
Selected elements are packed segment after segment, each segment's in ascending partition order, which is
also the order of `positions()` (so a device-side index_select with those positions packs the same way)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

SEGMENT_FIELDS = 6  # part_start, len, param_off, cols, idx_start, idx_count


@dataclass
class ColumnLayout:
    """The segment table (int64 [n, 6]) and every segment's sorted column indices (int32, concatenated)."""
    segments: torch.Tensor
    idx: torch.Tensor

    @staticmethod
    def build(slices: Sequence[tuple[int, int, int, int]], cols: Sequence[int],
              selected: Sequence[Optional[torch.Tensor]]) -> "ColumnLayout":
        """slices: (param, param_off, part_start, len) of the partition; cols[param]: its row length;
        selected[param]: its selected column indices (None: a parameter ZenFlow does not split)."""
        rows, idx, at = [], [], 0
        for param, param_off, part_start, length in slices:
            sel = selected[param]
            if sel is None or length <= 0:
                continue
            sel = torch.sort(sel.to(device="cpu", dtype=torch.int32)).values
            rows.append([part_start, length, param_off, int(cols[param]), at, sel.numel()])
            idx.append(sel)
            at += sel.numel()
        segments = torch.tensor(rows, dtype=torch.int64).reshape(-1, SEGMENT_FIELDS)
        return ColumnLayout(segments, torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int32))

    def positions(self) -> torch.Tensor:
        """Partition positions of the selected elements, in packed order (int64, host)."""
        out = []
        for (part_start, length, param_off, cols, i0, k) in self.segments.tolist():
            sel = self.idx[i0:i0 + k].to(torch.int64)
            r0, r1 = param_off // cols, (param_off + length - 1) // cols
            flat = (torch.arange(r0, r1 + 1, dtype=torch.int64)[:, None] * cols + sel[None, :]).reshape(-1)
            keep = (flat >= param_off) & (flat < param_off + length)
            out.append(flat[keep] - param_off + part_start)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)

    def count(self) -> int:
        return int(_op(None).count(self.segments, self.idx))


def gather_reference(part: torch.Tensor, layout: ColumnLayout) -> torch.Tensor:
    return part[layout.positions().to(part.device)]


def scatter_reference(part: torch.Tensor, layout: ColumnLayout, vals: torch.Tensor) -> None:
    part[layout.positions().to(part.device)] = vals


def gather(part: torch.Tensor, layout: ColumnLayout, out: Optional[torch.Tensor] = None,
           simd: Optional[str] = None) -> torch.Tensor:
    """The selected elements of a host float32 partition, packed (C core)."""
    op = _op(simd)
    if out is None:
        out = torch.empty(op.count(layout.segments, layout.idx), dtype=torch.float32)
    op.gather(part, layout.segments, layout.idx, out)
    return out


def scatter(part: torch.Tensor, layout: ColumnLayout, vals: torch.Tensor, simd: Optional[str] = None) -> None:
    """The selected elements of a host float32 partition set from `vals` (packed), in place (C core)."""
    _op(simd).scatter(part, layout.segments, layout.idx, vals)


@functools.lru_cache(maxsize=None)
def _op(simd: Optional[str]):
    from deepspeed_c.ops.op_builder import ZenFlowColumnsBuilder

    return ZenFlowColumnsBuilder(simd=simd).load()
