"""Data-parallel gradient reduction through the C bucket planner.

Every trainable parameter gets a post-accumulate-grad hook. On a backward that must reduce (a
gradient-accumulation boundary outside no_sync), each hook copies its gradient into its slot of a
contiguous bucket buffer and tells the planner; every bucket the planner reports ready (in bucket
order, identical on all ranks) is all-reduced asynchronously through deepspeed_c.comm while
backward goes on. At the end of backward the parameters that got no gradient are filled with
zeros (as DeepSpeed does), the remaining buckets go out, every reduction is awaited and averaged,
and each parameter's .grad becomes a view of its slot. Other backwards only accumulate locally.

A parameter whose gradient arrives twice in one backward (a weight shared by two reentrant
activation-checkpoint segments: each segment's recomputation runs its own nested backward) is
copied again while its bucket has not gone out; after that it is "late", and once the round's
buckets are in, the late parameters' whole local gradients are all-reduced once more and replace
their slots. Every rank runs the same graph, so the late set and that extra collective match.

Where a gradient is read from and where the reduced one goes is a `GradSlots` policy: `param.grad`
by default, or the fp32 accumulators of the bf16 stage-0 optimizer (grad_accum_dtype fp32).

After its first round the reducer adopts rank 0's observed gradient order (broadcast, so every
rank plans identically) and re-plans once, so later buckets fill in true backward order.

The collective each bucket goes through, and its pre/post factors, are a strategy chosen once here
(runtime/reduce_strategy.py): an all-reduce of the whole bucket."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.runtime.backward_round import BackwardRound
from deepspeed_c.runtime.bucket_plan import BucketPlan
from deepspeed_c.runtime.reduce_strategy import BucketReduce, averaging_factors, data_parallel_strategy


FIRST_BUCKET_BYTES = 1 << 20
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # absent in some torch builds: buckets then reused


def _storage_refs(buffer: torch.Tensor) -> int:
    """How many tensors share the buffer's storage (-1 where this torch cannot say)."""
    return -1 if _use_count is None else int(_use_count(buffer.untyped_storage()._cdata))


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


class ParamGradSlots:
    """Gradients are read from and reduced results written back to `param.grad`."""

    def read(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return param.grad

    @torch.no_grad()
    def write(self, param: torch.nn.Parameter, reduced: torch.Tensor) -> None:
        if reduced.dtype == param.dtype:
            param.grad = reduced  # a view of the bucket: no copy
        elif param.grad is None:
            param.grad = reduced.to(param.dtype)
        else:
            param.grad.copy_(reduced)


class GradientReducer(BackwardRound):

    def __init__(self, params: Sequence[torch.nn.Parameter], *, world_size: int, bucket_cap: int,
                 should_reduce: Callable[[], bool], group: Any = None, comm_dtype: Optional[torch.dtype] = None,
                 prescale_gradients: bool = False, gradient_predivide_factor: float = 1.0,
                 gradient_average: bool = True,
                 rebuild_from_observed_order: bool = True, slots: Any = None,
                 sequence_parallel_size: int = 1) -> None:
        self.params = list(params)
        self.slots = slots or ParamGradSlots()
        self.world_size = world_size
        self.group = group
        self.bucket_cap = max(1, int(bucket_cap))
        self.comm_dtype = comm_dtype
        self.should_reduce = should_reduce
        # Ulysses: the group is data x sequence ranks; a sequence group's partial gradients add up, only the
        # data-parallel replicas are averaged (DeepSpeed divides by world / sequence_parallel_size)
        self._averaging = dict(prescale_gradients=prescale_gradients,
                               gradient_predivide_factor=gradient_predivide_factor,
                               sequence_parallel_size=sequence_parallel_size)
        factors = averaging_factors(world_size, gradient_average=gradient_average, **self._averaging)
        self.strategy: BucketReduce = data_parallel_strategy(factors, group)
        self._post = self.strategy.post_factor
        self._rebuild_pending = rebuild_from_observed_order and world_size > 1
        self._replanned = False
        self._saved_order: Optional[list[int]] = None  # adopted from a checkpoint, laid out at the next backward
        self._order = list(range(len(self.params) - 1, -1, -1))
        kinds: dict[tuple[torch.dtype, torch.device], int] = {}
        self._keys = [kinds.setdefault((p.dtype, p.device), len(kinds)) for p in self.params]
        self._handed_out = False  # reduced gradients given to the parameters and not yet released by a step
        self.fresh_buckets = 0  # buckets given new storage because a gradient of theirs was still held
        self._plan_buckets(None)
        self._launched = 0
        self._works: list[Any] = []
        self._seen = [False] * len(self.params)
        self._late: set[int] = set()
        self.rounds = 0
        self._attach_hooks(self.params)

    # -- planning --------------------------------------------------------------------------------
    def _plan_buckets(self, order: Optional[list[int]]) -> None:
        # a small first bucket (1 MiB, as torch DDP does) starts communication early in backward
        itemsize = (torch.empty((), dtype=self.comm_dtype).element_size() if self.comm_dtype is not None
                    else (self.params[0].element_size() if self.params else 4))
        first_cap = min(self.bucket_cap, FIRST_BUCKET_BYTES // itemsize)
        self.plan = BucketPlan([p.numel() for p in self.params], self.bucket_cap, order=order, keys=self._keys,
                               first_cap=first_cap)
        self._mark = self.plan.marker()
        layout = self.plan.layout
        self.buffers: list[torch.Tensor] = []
        for b, numel in enumerate(layout.bucket_numels):
            first = self.params[layout.members[b][0]]
            dtype = self.comm_dtype or first.dtype
            self.buffers.append(torch.zeros(numel, dtype=dtype, device=first.device))
        self._make_views()
        self._same_dtype = [v.dtype == p.dtype for v, p in zip(self._views, self.params)]

    def _make_views(self) -> None:
        layout = self.plan.layout
        self._views = []
        for i, p in enumerate(self.params):
            b, off = layout.bucket_of[i], layout.offset_of[i]
            self._views.append(self.buffers[b][off:off + p.numel()].view(p.shape))
        self._own_refs = [_storage_refs(buf) for buf in self.buffers]  # the bucket and its views, nothing else

    def grads_released(self) -> None:
        """The engine's step cleared the gradients it was handed: the next round may reuse the buckets."""
        self._handed_out = False

    def _keep_handed_out_grads(self) -> None:
        """A reducing backward with no step since the last one, after a parameter's gradient was taken off it
        (`p.grad = None`, as DeepSpeed's tests do to compare two backwards): that gradient is a view of a bucket
        and whoever holds it keeps its values, so this round reduces into new buckets. With a step in between
        (the engine clears the gradients itself) the buckets are reused."""
        if not isinstance(self.slots, ParamGradSlots) or \
                all(p.grad is v for p, v, same in zip(self.params, self._views, self._same_dtype) if same):
            return
        old = self._views
        self.buffers = [torch.zeros_like(b) for b in self.buffers]
        self._make_views()
        with torch.no_grad():
            for p, before, now in zip(self.params, old, self._views):
                if p.grad is before:  # still the parameter's own (accumulating in place): it moves along
                    now.copy_(before)
                    p.grad = now

    def _keep_held_buckets(self) -> None:
        """A reducing backward after a step: a gradient the user kept from the last round (`g = p.grad`, kept
        across engine.step(), as DeepSpeed leaves it) still views its bucket, so that bucket gets new storage
        instead of being overwritten under the user. Nothing held: the buckets are reused (no allocation)."""
        # p.grad was the view object itself: a kept `g = p.grad` shows as a Python reference to it; a kept slice
        # or reshape of it as one more tensor on the bucket's storage
        held = {b for b, (buf, own) in enumerate(zip(self.buffers, self._own_refs))
                if own >= 0 and _storage_refs(buf) > own}
        bucket_of, views = self.plan.layout.bucket_of, self._views
        for i in range(len(views)):
            if sys.getrefcount(views[i]) > 2 and self.params[i].grad is not views[i]:  # 2: the list and the call
                held.add(bucket_of[i])
        if not held:
            return
        grads = [p.grad for p in self.params]
        for b in held:
            self.buffers[b] = torch.zeros_like(self.buffers[b])
        old = self._views
        self._make_views()
        self.fresh_buckets += len(held)
        with torch.no_grad():
            for p, g, before, now in zip(self.params, grads, old, self._views):
                if g is not None and g is before and now.data_ptr() != before.data_ptr():
                    now.copy_(before)
                    p.grad = now

    def set_gradient_average(self, average: bool) -> None:
        """engine.gradient_average assigned after initialize (DeepSpeed reads it at every reduction): the
        next reductions average (True) or sum (False) over the data-parallel ranks."""
        factors = averaging_factors(self.world_size, gradient_average=average, **self._averaging)
        self.strategy.set_factors(factors)
        self._post = factors.post

    @property
    def num_buckets(self) -> int:
        return self.plan.num_buckets

    @property
    def collectives(self) -> int:
        """All-reduces issued, for tests and the benchmark."""
        return self.strategy.collectives

    # -- backward-time path ----------------------------------------------------------------------
    def claim_round(self) -> None:
        self._apply_saved_order()
        super().claim_round()

    def _on_grad(self, index: int) -> None:
        if self._saved_order is not None:  # a backward the engine did not open (a bare loss.backward())
            self._apply_saved_order()
        grad = self.slots.read(self.params[index])
        if self._seen[index]:  # a second contribution in this backward (shared weight, reentrant segments)
            if self.plan.layout.bucket_of[index] < self._launched:
                self._late.add(index)  # its bucket is on the wire: re-reduced at the end of the round
            elif grad is not None:
                self._views[index].copy_(grad)
            return
        self._seen[index] = True
        if grad is not None:
            self._views[index].copy_(grad)
        else:
            self._views[index].zero_()
        frontier = self._mark(index)
        while self._launched < frontier:
            self._launch(self._launched)

    def _start_reducing(self) -> None:
        if self._handed_out:
            self._keep_handed_out_grads()
        elif self.rounds:
            self._keep_held_buckets()
        self.plan.reset()
        self._launched = 0
        self._works = []
        self._seen = [False] * len(self.params)
        self._late = set()

    def _launch(self, bucket: int) -> None:
        self._works.append(self.strategy.reduce(self.buffers[bucket])[0])
        self._launched = bucket + 1

    def _finish_round(self) -> None:
        for i in self.plan.pending():
            grad = self.slots.read(self.params[i])
            if grad is None:
                self._views[i].zero_()
            else:
                self._views[i].copy_(grad)
        frontier = self.plan.mark_all()
        while self._launched < frontier:
            self._launch(self._launched)
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []
        if self._late:
            self._reduce_late()
        if self._post != 1.0:
            torch._foreach_mul_(self.buffers, self._post)
        for i, p in enumerate(self.params):
            self.slots.write(p, self._views[i])
        self._handed_out = True
        self.rounds += 1
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._adopt_observed_order()

    @torch.no_grad()
    def _reduce_late(self) -> None:
        """The late parameters' whole local gradients, all-reduced together, replace their slots."""
        late = sorted(self._late)
        self._late = set()
        grads = [self.slots.read(self.params[i]) for i in late]
        flat = torch.cat([g.reshape(-1).to(self._views[i].dtype) for i, g in zip(late, grads)])
        work, flat = self.strategy.reduce(flat)
        if work is not None:
            work.wait()
        off = 0
        for i in late:
            n = self._views[i].numel()
            self._views[i].copy_(flat[off:off + n].view_as(self._views[i]))
            off += n

    def ordered_param_count(self) -> int:
        return len(self.params)

    def adopted_order(self) -> Optional[list[int]]:
        """The bucket order re-planned from the first backward (None before it): what a checkpoint keeps."""
        if self._saved_order is not None:
            return list(self._saved_order)
        return None if self._rebuild_pending or not self._replanned else list(self._order)

    def adopt_order(self, order: list[int]) -> None:
        """Takes a saved order (checkpointing/reducer_order.py) instead of re-planning after the next backward. It is
        laid out when that backward starts: a checkpoint load may still be reshaping the parameters (AutoTP
        loads whole weights, then cuts them back into shards)."""
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"gradient reducer: a saved bucket order must permute its {len(self.params)} "
                             f"parameters, got {len(order)} entries")
        self._rebuild_pending = False
        self._saved_order = list(order)

    def _apply_saved_order(self) -> None:
        order, self._saved_order = self._saved_order, None
        if order is not None:
            self._set_order(order)

    def _adopt_observed_order(self) -> None:
        """Re-plan in rank 0's observed gradient order (every rank receives the same order)."""
        observed = self.plan.arrival()
        if len(observed) != len(self.params):
            return
        device = self.params[0].device if self.params else torch.device("cpu")
        order = torch.tensor(observed, dtype=torch.int64, device=device)
        dist = _comm()
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(order, src=src, group=self.group)
        self._set_order(order.tolist())

    def _set_order(self, new_order: list[int]) -> None:
        self._replanned = True
        if new_order != self._order:
            grads = [p.grad for p in self.params]
            self._order = new_order
            self._plan_buckets(new_order)
            # the grads were views of the old buffers: keep their values in the new ones
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    if grads[i] is not None and self._same_dtype[i]:
                        self._views[i].copy_(grads[i])
                        p.grad = self._views[i]
