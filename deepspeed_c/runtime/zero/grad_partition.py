"""ZeRO-1/2 gradient reduction in the runtime layout of deepspeed_c.ops.partition.

Each parameter group's trainable parameters are laid out by a PartitionPlan: buckets of W equal
per-rank chunks, so one `reduce_scatter_tensor` per bucket leaves rank r holding the reduced
chunk r of every bucket, which is exactly its slice of the group's fp32 master partition.

Outside an accumulation boundary gradients simply accumulate in `param.grad` (no communication).
On a reducing backward each post-accumulate-grad hook copies its gradient into its slot of the
bucket buffer; a bucket whose members have all arrived is reduce-scattered asynchronously (stage 2,
which then frees `param.grad`), while stage 1 keeps the full gradients and sends every bucket at the
end of backward. Buckets go out in one fixed order on every rank (collectives must match).
The reduced partition (`grad_partitions[g]`, communication dtype, already averaged) is what the
ZeRO optimizer steps on. Same interface as runtime/reducer.GradientReducer (end_backward, remove),
so the engine drives either one."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.ops.partition import PartitionPlan


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


class ZeroGradPartitioner:

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], plans: Sequence[PartitionPlan], *,
                 rank: int, world_size: int, should_reduce: Callable[[], bool], group: Any = None,
                 comm_dtype: Optional[torch.dtype] = None, free_grads: bool = True, overlap: bool = True,
                 prescale_gradients: bool = False, gradient_predivide_factor: float = 1.0) -> None:
        self.groups = [list(g) for g in groups]
        self.plans = list(plans)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.should_reduce = should_reduce
        self.free_grads = free_grads
        self.overlap = overlap
        if prescale_gradients:
            self.pre_factor, self.post_factor = 1.0 / world_size, 1.0
        else:
            self.pre_factor = 1.0 / gradient_predivide_factor
            self.post_factor = gradient_predivide_factor / world_size
        # the order every rank sends buckets in: group-major, bucket order of each plan
        self.order: list[tuple[int, int]] = [(g, b) for g, plan in enumerate(self.plans)
                                             for b in range(plan.num_buckets)]
        self._slot_of = {(g, b): k for k, (g, b) in enumerate(self.order)}
        self._where: list[tuple[int, int]] = [(g, i) for g, params in enumerate(self.groups)
                                              for i in range(len(params))]
        self._members: list[list[int]] = [[] for _ in self.order]
        for k, (g, i) in enumerate(self._where):
            self._members[self._slot_of[(g, self.plans[g].param_bucket[i])]].append(k)
        self._flat_params = [p for params in self.groups for p in params]
        self.comm_dtypes = [comm_dtype or (params[0].dtype if params else torch.float32) for params in self.groups]
        self.grad_partitions: list[Optional[torch.Tensor]] = [None] * len(self.groups)
        self._bufs: list[Optional[torch.Tensor]] = [None] * len(self.order)
        self._remaining = [len(m) for m in self._members]
        self._arrived = [False] * len(self._flat_params)
        self._next = 0
        self._works: list[tuple[Any, torch.Tensor]] = []
        self._round_open = False
        self._reducing = False
        self.rounds = 0
        self.collectives = 0  # reduce-scatters issued, for tests
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(k))
                         for k, p in enumerate(self._flat_params)]

    # -- layout helpers ----------------------------------------------------------------------------
    def _device(self, g: int) -> torch.device:
        return self.groups[g][0].device

    def chunk_range(self, g: int, b: int) -> tuple[int, int]:
        """[start, end) of bucket b's chunk inside this rank's partition of group g."""
        plan = self.plans[g]
        start = plan.bucket_offset[b] // self.world_size
        return start, start + plan.bucket_size[b] // self.world_size

    # -- backward-time path ------------------------------------------------------------------------
    def _hook_for(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(k)

        return hook

    def _open_round(self) -> None:
        self._round_open = True
        self._reducing = bool(self.should_reduce())
        if self._reducing:
            self._remaining = [len(m) for m in self._members]
            self._arrived = [False] * len(self._flat_params)
            self._next = 0
            self._works = []
            for g, params in enumerate(self.groups):
                size = self.plans[g].runtime_partition_size
                self.grad_partitions[g] = torch.zeros(size, dtype=self.comm_dtypes[g], device=self._device(g))
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def _bucket(self, slot: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None:
            g, b = self.order[slot]
            buf = torch.zeros(self.plans[g].bucket_size[b], dtype=self.comm_dtypes[g], device=self._device(g))
            self._bufs[slot] = buf
        return buf

    def _deposit(self, k: int) -> int:
        g, i = self._where[k]
        plan = self.plans[g]
        b = plan.param_bucket[i]
        slot = self._slot_of[(g, b)]
        p = self._flat_params[k]
        if p.grad is not None:
            off = plan.param_offset[i] - plan.bucket_offset[b]
            self._bucket(slot)[off:off + p.numel()].copy_(p.grad.detach().reshape(-1))
            if self.free_grads:
                p.grad = None
        self._arrived[k] = True
        self._remaining[slot] -= 1
        return slot

    def _on_grad(self, k: int) -> None:
        if not self._round_open:
            self._open_round()
        if not self._reducing or self._arrived[k]:
            return
        self._deposit(k)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._remaining[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, slot: int) -> None:
        g, b = self.order[slot]
        buf = self._bucket(slot)
        self._bufs[slot] = None
        if self.pre_factor != 1.0:
            buf.mul_(self.pre_factor)
        start, end = self.chunk_range(g, b)
        out = self.grad_partitions[g][start:end]
        if self.world_size == 1:
            out.copy_(buf)
            return
        work = _comm().reduce_scatter_tensor(out, buf, group=self.group, async_op=True)
        self._works.append((work, buf))
        self.collectives += 1

    def end_backward(self) -> None:
        """Flush, await and average (idempotent: a no-op outside a reducing backward)."""
        if not self._round_open:
            return
        try:
            if self._reducing:
                self._finish_round()
        finally:
            self._round_open = False
            self._reducing = False

    def _finish_round(self) -> None:
        # parameters whose hook did not fire this backward (unused, or grads from earlier micro-steps)
        for k in range(len(self._flat_params)):
            if not self._arrived[k]:
                self._deposit(k)
        self._launch_ready()
        for work, _ in self._works:
            if work is not None:
                work.wait()
        self._works = []
        if self.post_factor != 1.0:
            torch._foreach_mul_([t for t in self.grad_partitions if t is not None], self.post_factor)
        self.rounds += 1

    def clear(self) -> None:
        self.grad_partitions = [None] * len(self.groups)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
