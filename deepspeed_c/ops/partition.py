"""Partition arithmetic for ZeRO (a thin wrapper over the C partitioner, `_C.partition_plan`).

One `PartitionPlan` per parameter group gives two maps of every element across W ranks:
- the runtime layout: bucketed, each bucket W equal chunks (one reduce_scatter per bucket);
- DeepSpeed's layout: one padded flat buffer, rank r owns [r * P, (r + 1) * P) (the layout of
  DeepSpeed's ZeRO-1/2 optimizer checkpoints).
Both runtime/zero and checkpoint/ use it to move state between the layouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# DeepSpeed pads ZeRO-1/2 flat groups to a multiple of 2 * world_size elements
# (its nccl_start_alignment_factor of 2).
DEEPSPEED_ALIGNMENT = 2

SLICE_FIELDS = ("param", "rank", "param_start", "local_start", "length", "bucket")


@dataclass(frozen=True)
class PartitionPlan:
    numels: tuple[int, ...]
    world_size: int
    bucket_offset: tuple[int, ...]
    bucket_size: tuple[int, ...]
    bucket_numel: tuple[int, ...]
    param_bucket: tuple[int, ...]
    param_offset: tuple[int, ...]
    runtime_total: int
    runtime_partition_size: int
    runtime_slices: torch.Tensor  # int64 [S, 6], columns SLICE_FIELDS
    ds_param_offset: tuple[int, ...]
    ds_total: int
    ds_partition_size: int
    ds_slices: torch.Tensor

    @staticmethod
    def build(numels: Sequence[int], world_size: int, bucket_cap: int, align: int = DEEPSPEED_ALIGNMENT,
              runtime_order: Sequence[int] | None = None,
              param_bucket: Sequence[int] | None = None) -> "PartitionPlan":
        """Buckets cut by `bucket_cap` along `runtime_order`, or, with `param_bucket`, as given (a
        bucket id per parameter, numbered 0, 1, ... along the order, each bucket one contiguous run:
        e.g. module-aligned buckets)."""
        from deepspeed_c import _C

        raw = _C.partition_plan([int(n) for n in numels], int(world_size), int(bucket_cap), int(align),
                                None if runtime_order is None else [int(i) for i in runtime_order],
                                None if param_bucket is None else [int(b) for b in param_bucket])
        fields = dict(raw)
        for key in ("runtime_slices", "ds_slices"):
            fields[key] = torch.tensor(fields[key], dtype=torch.int64).view(-1, 6)
        return PartitionPlan(numels=tuple(int(n) for n in numels), **fields)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_size)

    def slices(self, layout: str, rank: int | None = None) -> list[tuple[int, ...]]:
        table = {"runtime": self.runtime_slices, "deepspeed": self.ds_slices}[layout]
        if rank is not None:
            table = table[table[:, 1] == rank]
        return [tuple(row) for row in table.tolist()]

    def partition_size(self, layout: str) -> int:
        return {"runtime": self.runtime_partition_size, "deepspeed": self.ds_partition_size}[layout]

    # --- moving data between layouts ------------------------------------------------------
    def gather_params(self, partitions: Sequence[torch.Tensor], layout: str) -> list[torch.Tensor]:
        """Whole flat parameters from every rank's partition (index = rank) in `layout`."""
        if len(partitions) != self.world_size:
            raise ValueError(f"expected {self.world_size} partitions, got {len(partitions)}")
        size = self.partition_size(layout)
        for r, part in enumerate(partitions):
            if part.numel() != size:
                raise ValueError(f"partition {r} has {part.numel()} elements; the {layout} layout gives "
                                 f"each rank {size}")
        ref = partitions[0]
        out = [torch.empty(n, dtype=ref.dtype, device=ref.device) for n in self.numels]
        for param, rank, pstart, lstart, length, _ in self.slices(layout):
            out[param][pstart:pstart + length] = partitions[rank].view(-1)[lstart:lstart + length]
        return out

    def scatter_params(self, params: Sequence[torch.Tensor], layout: str, rank: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank `rank`'s partition in `layout`, cut from whole parameters (padding zeroed)."""
        if len(params) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} parameters, got {len(params)}")
        for i, (p, n) in enumerate(zip(params, self.numels)):
            if p.numel() != n:
                raise ValueError(f"parameter {i} has {p.numel()} elements; the plan expects {n}")
        size = self.partition_size(layout)
        if out is None:
            ref = params[0] if params else torch.empty(0)
            out = torch.zeros(size, dtype=ref.dtype, device=ref.device)
        else:
            out.zero_()
        for param, _, pstart, lstart, length, _ in self.slices(layout, rank):
            out[lstart:lstart + length] = params[param].reshape(-1)[pstart:pstart + length]
        return out

    def convert(self, partitions: Sequence[torch.Tensor], src_layout: str, dst_layout: str,
                dst_plan: "PartitionPlan | None" = None) -> list[torch.Tensor]:
        """Every rank's partition re-cut from one layout (this plan) into another layout of
        `dst_plan` (default this plan): also the resharding path between world sizes."""
        dst = dst_plan or self
        params = self.gather_params(partitions, src_layout)
        return [dst.scatter_params(params, dst_layout, r) for r in range(dst.world_size)]
