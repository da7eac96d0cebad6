"""Where every element of a parameter group goes when it moves from one partition layout to another.

A layout is one of a PartitionPlan's slice tables (rows: param, rank, param_start, local_start, length,
bucket); two layouts of the same parameters (runtime <-> DeepSpeed, or DeepSpeed at N ranks -> runtime at
M ranks) are intersected per parameter into routes: rows (src_rank, src_local, dst_rank, dst_local,
length), each a run that is contiguous on both sides. Only the routes are computed (O(slices log
slices), vectorised); no element is touched, so a checkpoint can move exactly the elements whose owner
changes, point to point, instead of gathering whole partitions."""
from __future__ import annotations

from typing import Sequence

import torch

from deepspeed_c.ops.partition import PartitionPlan

ROUTE_FIELDS = ("src_rank", "src_local", "dst_rank", "dst_local", "length")


def _sorted_rows(table: torch.Tensor, offsets: torch.Tensor, total: int, what: str) -> torch.Tensor:
    """(key, rank, local, length) sorted by key, the row's start in the concatenated parameters; checks
    that the rows cover [0, total) exactly once."""
    rows = table[table[:, 4] > 0]
    key = offsets[rows[:, 0]] + rows[:, 2]
    out = torch.stack([key, rows[:, 1], rows[:, 3], rows[:, 4]], dim=1)
    out = out[torch.argsort(key, stable=True)]
    ends = out[:, 0] + out[:, 3]
    starts_ok = out.shape[0] == 0 or (int(out[0, 0]) == 0 and bool((out[1:, 0] == ends[:-1]).all()))
    if not starts_ok or (int(ends[-1]) if out.shape[0] else 0) != total:
        raise ValueError(f"the {what} layout's slices do not cover the group's {total} elements exactly once")
    return out


def route(numels: Sequence[int], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Routes (int64 [K, 5], columns ROUTE_FIELDS) moving the parameters `numels` from the slice table
    `src` to the slice table `dst`; runs contiguous on both sides are merged, and rows are ordered by
    their position in the concatenated parameters (the same on every rank)."""
    sizes = torch.tensor([int(n) for n in numels], dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    a = _sorted_rows(src, offsets, total, "source")
    b = _sorted_rows(dst, offsets, total, "destination")
    if total == 0:
        return torch.zeros(0, 5, dtype=torch.int64)
    cuts = torch.unique(torch.cat([a[:, 0], b[:, 0]]))  # sorted; every run starts at one of them
    length = torch.diff(cuts, append=torch.tensor([total]))
    ia = torch.searchsorted(a[:, 0].contiguous(), cuts, right=True) - 1
    ib = torch.searchsorted(b[:, 0].contiguous(), cuts, right=True) - 1
    runs = torch.stack([a[ia, 1], a[ia, 2] + cuts - a[ia, 0], b[ib, 1], b[ib, 2] + cuts - b[ib, 0], length], 1)
    return _merge(runs)


def _merge(runs: torch.Tensor) -> torch.Tensor:
    """Adjacent runs (in parameter order) that continue each other on both sides become one."""
    if runs.shape[0] < 2:
        return runs
    prev, cur = runs[:-1], runs[1:]
    cont = ((cur[:, 0] == prev[:, 0]) & (cur[:, 2] == prev[:, 2]) & (cur[:, 1] == prev[:, 1] + prev[:, 4])
            & (cur[:, 3] == prev[:, 3] + prev[:, 4]))
    head = torch.cat([torch.tensor([True]), ~cont])
    group = torch.cumsum(head.to(torch.int64), 0) - 1
    out = runs[head].clone()
    out[:, 4] = torch.zeros(out.shape[0], dtype=torch.int64).index_add_(0, group, runs[:, 4])
    return out


def layout_route(src_plan: PartitionPlan, src_layout: str, dst_plan: PartitionPlan, dst_layout: str) -> torch.Tensor:
    """Routes from `src_layout` of `src_plan` to `dst_layout` of `dst_plan` (same parameters; the world
    sizes may differ)."""
    if tuple(src_plan.numels) != tuple(dst_plan.numels):
        raise ValueError(f"the two plans partition different parameters ({len(src_plan.numels)} vs "
                         f"{len(dst_plan.numels)} tensors, {sum(src_plan.numels)} vs {sum(dst_plan.numels)} elements)")
    tables = {"runtime": lambda p: p.runtime_slices, "deepspeed": lambda p: p.ds_slices}
    return route(src_plan.numels, tables[src_layout](src_plan), tables[dst_layout](dst_plan))
