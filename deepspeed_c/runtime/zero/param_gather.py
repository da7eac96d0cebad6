"""The ZeRO-1/2 parameter all-gather: each rank's updated chunk of a bucket (model dtype, on the
model's device) is all-gathered, one asynchronous collective per bucket. Where the group's parameters
are views of a flat buffer (flat_model_params) the gather writes straight into the model, in place
when the chunk already sits in this rank's slot; otherwise into a bucket buffer whose parameter
slices are then copied into the parameters, with at most `allgather_bucket_size` elements of such
buffers in flight. Chunks may be submitted while the optimizer is still stepping later ones (the
fused epilogue and the offload path do), so gathers overlap the step."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.zero.flat_model_params import FlatModelParams


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


class BucketGatherer:

    def __init__(self, plans: Sequence[PartitionPlan], groups: Sequence[Sequence[torch.nn.Parameter]], *,
                 world_size: int, group: Any = None, cap: int = int(5e8),
                 flat: Optional[FlatModelParams] = None) -> None:
        self.plans = list(plans)
        self.flat = flat
        self.groups = [list(g) for g in groups]
        self.world_size = world_size
        self.group = group
        self.cap = max(1, int(cap))
        self.members: list[list[list[int]]] = []
        for plan in self.plans:
            members: list[list[int]] = [[] for _ in range(plan.num_buckets)]
            for i, b in enumerate(plan.param_bucket):
                members[b].append(i)
            self.members.append(members)
        self._pending: list[tuple[Any, Optional[torch.Tensor], int, int]] = []
        self._in_flight = 0
        self.collectives = 0

    @torch.no_grad()
    def submit(self, g: int, b: int, chunk: torch.Tensor) -> None:
        """This rank's updated chunk of bucket b of group g (len = bucket size / W)."""
        size = self.plans[g].bucket_size[b]
        if chunk.numel() * self.world_size != size:
            raise ValueError(f"bucket {b} of group {g}: chunk has {chunk.numel()} elements, expected "
                             f"{size // self.world_size}")
        flat = None if self.flat is None else self.flat.bucket(g, b)
        if self.world_size == 1:
            if flat is None:
                self._fill(g, b, chunk)
            elif flat.data_ptr() != chunk.data_ptr():
                flat.copy_(chunk)
            return
        if flat is not None:  # straight into the model's parameters: nothing to copy afterwards
            work = _comm().all_gather_into_tensor(flat, chunk, group=self.group, async_op=True)
            self.collectives += 1
            self._pending.append((work, None, g, b))
            return
        while self._pending and self._in_flight + size > self.cap:
            self._finish_oldest()
        full = torch.empty(size, dtype=chunk.dtype, device=chunk.device)
        work = _comm().all_gather_into_tensor(full, chunk, group=self.group, async_op=True)
        self.collectives += 1
        self._pending.append((work, full, g, b))
        self._in_flight += size

    def _finish_oldest(self) -> None:
        work, full, g, b = self._pending.pop(0)
        if work is not None:
            work.wait()
        if full is not None:
            self._in_flight -= full.numel()
            self._fill(g, b, full)

    @torch.no_grad()
    def finish(self) -> None:
        while self._pending:
            self._finish_oldest()

    def _fill(self, g: int, b: int, full: torch.Tensor) -> None:
        plan, params = self.plans[g], self.groups[g]
        dst, src = [], []
        for i in self.members[g][b]:
            off = plan.param_offset[i] - plan.bucket_offset[b]
            dst.append(params[i].data)
            src.append(full[off:off + params[i].numel()].view_as(params[i]))
        if dst:
            torch._foreach_copy_(dst, src)
