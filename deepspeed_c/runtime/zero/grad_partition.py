"""ZeRO-1/2 gradient reduction in the runtime layout of deepspeed_c.ops.partition.

Each parameter group's trainable parameters are laid out by a PartitionPlan: buckets of W equal
per-rank chunks, so one `reduce_scatter_tensor` per bucket leaves rank r holding the reduced
chunk r of every bucket, which is exactly its slice of the group's fp32 master partition.

Stage 2 (the engine's should_reduce is true on every micro-step) reduces every micro-step, as
DeepSpeed does: each post-accumulate-grad hook copies its gradient into its slot of the bucket
buffer and frees `param.grad`; a bucket whose members have all arrived goes out at once, and its
reduced chunk is added into the partition, so between steps a rank holds only 1/W of the gradients.
Stage 1 lets gradients accumulate in `param.grad` and reduces once, on the accumulation boundary.
Buckets go out in one fixed order on every rank (collectives must match): readiness is counted
by the C bucket planner (runtime/bucket_plan.py, the one stage 0 uses) over the partition plans'
buckets, which reports the frontier below which every bucket may go.

A parameter's gradient can arrive twice in one backward: a weight shared by two reentrant
activation-checkpoint segments gets one hook per segment's nested backward. The second part is
added into the bucket if it has not gone out yet; otherwise into a "late" copy of the bucket, which
goes out once more at the end of the round and is added into the partition. Every rank runs the
same graph, so the late buckets, and their collectives, match across ranks.

The reduced partition (`grad_partitions[g]`, communication dtype, averaged over ranks) is what the
ZeRO optimizer steps on; `grad_partition(g)` hands it out. The collective a bucket goes through is a
strategy chosen once at construction (runtime/reduce_strategy.py): a reduce-scatter (NCCL averaging
in it where it can), ZeRO++ qgZ's quantized one (`quantized_reduce`), or with `use_reduce_scatter=False`
an all-reduce keeping the local chunk (DeepSpeed's switch; twice the bytes). A `side_stream` (CUDA,
the offload path's) finishes each bucket there instead of at the end of backward, and
`on_bucket_final(g, start, end, chunk)` then runs on that stream on the accumulation boundary: the
device-to-host copy of the finished chunk overlaps the rest of backward. Without one, at most
`in_flight_window` sent buckets stay unfinished: sending another finishes the oldest (a rank holds the
buckets being filled and one in flight, not every bucket of the backward). Same interface as
runtime/reducer.GradientReducer (end_backward, remove), so the engine drives either one."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.backward_round import BackwardRound
from deepspeed_c.runtime.bucket_plan import BucketPlan
from deepspeed_c.runtime.reduce_strategy import BucketReduce, averaging_factors, partition_strategy

BucketFinal = Callable[[int, int, int, torch.Tensor], None]  # (group, start, end, the final chunk)


def chunk_range(plan: PartitionPlan, b: int, world_size: int) -> tuple[int, int]:
    """[start, end) of bucket b's chunk inside each rank's partition of the plan's group (_launch repeats it)."""
    start = plan.bucket_offset[b] // world_size
    return start, start + plan.bucket_size[b] // world_size


IN_FLIGHT_ENV = "DSC_ZERO_REDUCE_WINDOW"  # sent buckets kept unfinished (0: all, to the end of backward)
IN_FLIGHT_DEFAULT = 1


def in_flight_window() -> int:
    """How many sent buckets may be unfinished at once (DSC_ZERO_REDUCE_WINDOW, default 1; 0 keeps every
    one to the end of backward, the earlier behaviour, for A/B runs)."""
    raw = os.environ.get(IN_FLIGHT_ENV, "").strip()
    if not raw:
        return IN_FLIGHT_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{IN_FLIGHT_ENV} must be an integer >= 0, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{IN_FLIGHT_ENV} must be an integer >= 0, got {value}")
    return value


def grad_dtypes(groups: Sequence[Sequence[torch.nn.Parameter]], comm_dtype: Optional[torch.dtype],
                accumulate_fp32: bool = False) -> list[torch.dtype]:
    """Each group's reduced-gradient dtype: fp32 under fp32 accumulation, else the communication dtype,
    else the group's parameter dtype."""
    if accumulate_fp32:
        comm_dtype = torch.float32
    return [comm_dtype or (params[0].dtype if params else torch.float32) for params in groups]


@dataclass
class _InFlight:
    """One bucket's collective: `recv` receives this rank's reduced chunk (the partition slice
    itself on the first round of an accumulation window, else a temporary added into it)."""
    g: int
    b: int
    work: Any
    buf: torch.Tensor
    recv: torch.Tensor
    start: int
    end: int
    fresh: bool  # the first write into this chunk in the accumulation window: overwrite, not add


class ZeroGradPartitioner(BackwardRound):

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], plans: Sequence[PartitionPlan], *,
                 rank: int, world_size: int, should_reduce: Callable[[], bool],
                 is_boundary: Optional[Callable[[], bool]] = None, group: Any = None,
                 comm_dtype: Optional[torch.dtype] = None, overlap: bool = True,
                 use_reduce_scatter: bool = True,
                 prescale_gradients: bool = False, gradient_predivide_factor: float = 1.0,
                 gradient_average: bool = True, wait_each_bucket: bool = False,
                 accumulate_fp32: bool = False, sequence_parallel_size: int = 1,
                 quantized_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 side_stream: Any = None, on_bucket_final: Optional[BucketFinal] = None) -> None:
        self.groups = [list(g) for g in groups]
        self.plans = list(plans)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.should_reduce = should_reduce
        self.is_boundary = is_boundary or (lambda: True)
        self.overlap = overlap
        self.wait_each_bucket = wait_each_bucket
        self.use_reduce_scatter = use_reduce_scatter
        # Ulysses: the group is data x sequence ranks; a sequence group's partial gradients add up, only the
        # data-parallel replicas are averaged (DeepSpeed divides by world / sequence_parallel_size)
        factors = averaging_factors(world_size, gradient_average=gradient_average,
                                    prescale_gradients=prescale_gradients,
                                    gradient_predivide_factor=gradient_predivide_factor,
                                    sequence_parallel_size=sequence_parallel_size)
        self.strategy: BucketReduce = partition_strategy(factors, rank=rank, world_size=world_size, group=group,
                                                         reduce_scatter=use_reduce_scatter,
                                                         quantized_reduce=quantized_reduce)
        self._post = self.strategy.post_factor
        # only a reduce-scatter receives into the partition itself (the others produce the chunk elsewhere)
        self._into_partition = self.strategy.writes_out
        self._where: list[tuple[int, int]] = [(g, i) for g, params in enumerate(self.groups)
                                              for i in range(len(params))]
        self._flat_params = [p for params in self.groups for p in params]
        self._index_of = {id(p): k for k, p in enumerate(self._flat_params)}
        self._frontier = 0
        # accumulate_fp32 (stage 1, bf16 model, data_types.grad_accum_dtype "fp32": DeepSpeed's
        # BF16_Optimizer): each micro-step's gradient is folded into an fp32 accumulator as soon as
        # autograd has produced it, and the fp32 sums are what the boundary reduces
        self.accumulate_fp32 = accumulate_fp32
        self._acc: list[Optional[torch.Tensor]] = [None] * len(self._flat_params)
        self.comm_dtypes = grad_dtypes(self.groups, comm_dtype, accumulate_fp32)
        self.grad_partitions: list[Optional[torch.Tensor]] = [None] * len(self.groups)
        self._fresh = [True] * len(self.groups)  # partition not yet written in this accumulation window
        self._arrived = [False] * len(self._flat_params)
        self._direct = [False] * len(self._flat_params)  # a Linear wrote part of the gradient in place this round
        self._late: dict[int, torch.Tensor] = {}  # slot -> second contributions after its bucket went out
        self._next = 0
        self._in_flight: list[_InFlight] = []
        self._finished: list[_InFlight] = []  # finished on the side stream: kept alive until end of round
        # sent buckets not yet finished, at most: the oldest is finished (its collective waited for on the
        # current stream, its chunk folded into the partition, its buffer freed) as a newer one goes out.
        # Holding every bucket to the end of backward kept a whole unsharded gradient alive at its end
        # (2 bytes a parameter in bf16, on every rank); a bucket sent a unit's backward ago has finished
        self.in_flight_window = in_flight_window()
        self._boundary = True
        self.side_stream = side_stream
        self.on_bucket_final = on_bucket_final
        self.rounds = 0
        self.direct_writes = 0  # weight gradients a Linear wrote into their bucket slot (bucket_linear), for tests
        # the order every rank sends buckets in: group-major, bucket order of each plan (set_send_order changes it)
        self._lay_out([(g, b) for g, plan in enumerate(self.plans) for b in range(plan.num_buckets)])
        self.direct_linears: list = []  # set by install_direct_linears, with their sink
        self._direct_sink: Any = None
        self._attach_hooks(self._flat_params)

    # -- layout helpers ----------------------------------------------------------------------------
    def _lay_out(self, order: list[tuple[int, int]]) -> None:
        """Everything that depends on the send order: slots, readiness, gaps, each parameter's slot."""
        self.order = order
        self._slot_of = {(g, b): k for k, (g, b) in enumerate(order)}
        # readiness and launch order on the C bucket planner, over the partition plans' buckets (one
        # planner slot per (group, bucket), in the order every rank sends them)
        self.readiness = BucketPlan([self.plans[g].numels[i] for g, i in self._where], 1,
                                    assignment=[self._slot_of[(g, self.plans[g].param_bucket[i])]
                                                for g, i in self._where])
        self._mark = self.readiness.marker()
        self._bufs: list[Optional[torch.Tensor]] = [None] * len(order)
        # the bucket elements no parameter covers (alignment padding): zeroed when a bucket is allocated,
        # every other element is written by its parameter's deposit
        self._gaps = [self._bucket_gaps(g, b) for g, b in order]
        # per parameter (flat index): its bucket slot, offset in the bucket and numel (the plan's: at stage 3 a
        # released parameter is an empty placeholder); fixed by the plans, read by every gradient hook
        self._dst_spec: list[tuple[int, int, int]] = []
        for g, i in self._where:
            plan = self.plans[g]
            b = plan.param_bucket[i]
            self._dst_spec.append((self._slot_of[(g, b)], plan.param_offset[i] - plan.bucket_offset[b],
                                   plan.numels[i]))

    def set_send_order(self, order: Sequence[tuple[int, int]]) -> None:
        """Buckets go out in `order` (every (group, bucket) once; the same on every rank) instead of group-major
        plan order. A bucket goes out once it and every bucket before it are complete, so the order should be
        the one backward completes them in. Only between rounds."""
        order = [(int(g), int(b)) for g, b in order]
        if sorted(order) != sorted(self.order):
            raise ValueError("set_send_order: order must list every (group, bucket) of the plans exactly once")
        if self._round_open or any(b is not None for b in self._bufs):
            raise RuntimeError("set_send_order: a backward round is under way")
        self._lay_out(order)

    def _device(self, g: int) -> torch.device:
        return self.groups[g][0].device

    def chunk_range(self, g: int, b: int) -> tuple[int, int]:
        """[start, end) of bucket b's chunk inside this rank's partition of group g."""
        return chunk_range(self.plans[g], b, self.world_size)

    @property
    def reduced_params(self) -> list[torch.nn.Parameter]:
        """The reduced parameters, group after group (the index a hook and `touched` use). The partitioner
        keeps no bucket order for runtime/checkpointing/reducer_order.py (BucketOrderKeeping's defaults)."""
        return self._flat_params

    @property
    def collectives(self) -> int:
        """Reduce-scatters (or all-reduces) issued, for tests."""
        return self.strategy.collectives

    def grad_partition(self, g: int) -> torch.Tensor:
        """Group g's reduced gradient partition; zeros when no reducing backward wrote it since the last
        clear (the step then treats every gradient of the group as zero)."""
        part = self.grad_partitions[g]
        if part is None:
            part = torch.zeros(self.plans[g].runtime_partition_size, dtype=self.comm_dtypes[g], device=self._device(g))
            self.grad_partitions[g] = part
        return part

    def _bucket_gaps(self, g: int, b: int) -> list[tuple[int, int]]:
        plan = self.plans[g]
        base = plan.bucket_offset[b]
        spans = sorted((plan.param_offset[i] - base, plan.param_offset[i] - base + plan.numels[i])
                       for i in range(len(self.groups[g])) if plan.param_bucket[i] == b)
        gaps, at = [], 0
        for start, end in spans:
            if start > at:
                gaps.append((at, start))
            at = max(at, end)
        if at < plan.bucket_size[b]:
            gaps.append((at, plan.bucket_size[b]))
        return gaps

    # -- Linear weight gradients written into their slot (runtime/zero/bucket_linear.py) -------------
    def install_direct_linears(self, module: torch.nn.Module) -> None:
        from deepspeed_c.runtime.zero import bucket_linear

        self.direct_linears, self._direct_sink = bucket_linear.install(module, self)

    def reduced_param_ids(self) -> set[int]:
        return set(self._index_of)

    def direct_grad_slot(self, param: torch.nn.Parameter) -> Optional[tuple[int, torch.Tensor]]:
        """(index, the parameter's slot in its bucket shaped as the parameter) when its gradient may be
        written there directly in this backward, else None (the gradient then takes autograd's path).
        Arrival is still marked by the post-accumulate-grad hook, which autograd runs once every
        contribution of this graph task is in (with .grad holding the sum of the others, if any): a
        weight shared by two modules, or a Linear called twice, is not sent before its last part."""
        k = self._index_of.get(id(param))
        if k is None or self.accumulate_fp32 or param.grad is not None:
            return None
        hooks = param._backward_hooks
        if hooks and not (self._inert_hook is not None and all(map(self._inert_hook, hooks.values()))):
            return None  # someone else watches or changes this gradient: it must exist as a tensor
        if len(param._post_accumulate_grad_hooks or ()) != 1:
            return None
        g, _ = self._where[k]
        if self.comm_dtypes[g] != param.dtype or not self._enter_round() or self._arrived[k] or self._direct[k]:
            return None
        slot, off, n = self._dst_spec[k]
        return k, self._bucket(slot)[off:off + n].view(param.shape)

    def direct_grad_written(self, k: int) -> None:
        """The slot direct_grad_slot gave holds a first part of parameter k's gradient."""
        self._direct[k] = True
        self.direct_writes += 1

    # -- backward-time path ------------------------------------------------------------------------
    def _start_reducing(self) -> None:
        self._boundary = bool(self.is_boundary())
        self.readiness.reset()
        self._frontier = 0
        self._arrived = [False] * len(self._flat_params)
        self._direct = [False] * len(self._flat_params)
        self._late = {}
        self._next = 0
        self._in_flight = []
        self._finished = []
        for g in range(len(self.groups)):
            if self.grad_partitions[g] is None:
                self._fresh[g] = True
                # without a side stream the partition is made when the first bucket is folded into it (after a
                # few units of backward, whose activations are gone by then, not at the activation peak); the
                # side stream's buckets are finished on that stream, which must not own the partition's memory
                if self.side_stream is not None or not self.in_flight_window:
                    self._new_partition(g)

    def _new_partition(self, g: int) -> torch.Tensor:
        # every element is written by the first round's collectives (padding included)
        part = torch.empty(self.plans[g].runtime_partition_size, dtype=self.comm_dtypes[g], device=self._device(g))
        self.grad_partitions[g] = part
        return part

    def _bucket(self, slot: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None:
            g, b = self.order[slot]
            buf = torch.empty(self.plans[g].bucket_size[b], dtype=self.comm_dtypes[g], device=self._device(g))
            for start, end in self._gaps[slot]:
                buf[start:end].zero_()
            self._bufs[slot] = buf
        return buf

    def _take_grad(self, k: int) -> Optional[torch.Tensor]:
        """The parameter's gradient since it was last taken, flat and detached (copying it into a bucket
        never joins a create_graph backward's graph); `param.grad` is freed."""
        p = self._flat_params[k]
        if self.accumulate_fp32:
            self._fold(k)
            acc, self._acc[k] = self._acc[k], None
            return acc
        if p.grad is None:
            return None
        grad = p.grad.detach().reshape(-1)
        p.grad = None
        return grad

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        k = index

        def hook(param: torch.Tensor) -> None:
            # once per parameter per backward, so one frame: BackwardRound's hook with _on_grad and _deposit's
            # common path (first arrival, 16-bit accumulation) inlined; every other case goes through them
            self.touched.add(k)
            if not (self._reducing if self._round_open else self._enter_round()):
                if self.accumulate_fp32:  # _on_local_grad
                    self._fold(k)
                return
            if self._arrived[k] or self.accumulate_fp32:
                self._on_grad(k)
                return
            slot, off, n = self._dst_spec[k]
            p = self._flat_params[k]
            grad = p.grad
            if grad is not None:
                grad = grad.detach().reshape(-1)
                p.grad = None
            buf = self._bufs[slot]
            dst = (buf if buf is not None else self._bucket(slot))[off:off + n]
            if self._direct[k]:
                if grad is not None:
                    dst.add_(grad)
            elif grad is not None:
                dst.copy_(grad)
            else:
                dst.zero_()
            self._arrived[k] = True
            frontier = self._frontier = self._mark(k)
            if self.overlap and self._next < frontier:
                self._launch_ready()

        return hook

    def _deposit(self, k: int) -> int:
        # _hook_for's hook repeats this for the first arrival without fp32 accumulation: change both
        slot, off, n = self._dst_spec[k]
        if self.accumulate_fp32:
            grad = self._take_grad(k)
        else:
            p = self._flat_params[k]
            grad = p.grad
            if grad is not None:
                grad = grad.detach().reshape(-1)
                p.grad = None
        buf = self._bufs[slot]
        dst = (buf if buf is not None else self._bucket(slot))[off:off + n]
        if self._direct[k]:  # a Linear wrote a first part there; .grad holds the sum of any others
            if grad is not None:
                dst.add_(grad)
        elif grad is not None:
            dst.copy_(grad)
        else:  # no gradient this round (unused parameter): its slot counts as zero
            dst.zero_()
        self._arrived[k] = True
        self._frontier = self._mark(k)
        return slot

    def _deposit_again(self, k: int) -> None:
        slot, off, _ = self._dst_spec[k]
        grad = self._take_grad(k)
        if grad is None:
            return
        if slot >= self._next:  # its bucket has not gone out yet
            dst = self._bucket(slot)
        else:
            dst = self._late.get(slot)
            if dst is None:
                g, b = self.order[slot]
                dst = self._late[slot] = torch.zeros(self.plans[g].bucket_size[b], dtype=self.comm_dtypes[g],
                                                     device=self._device(g))
        dst[off:off + grad.numel()].add_(grad)

    @torch.no_grad()
    def _fold(self, k: int) -> None:
        """The parameter's fresh 16-bit gradient added into its fp32 accumulator, then freed."""
        p = self._flat_params[k]
        if p.grad is None:
            return
        if self._acc[k] is None:
            self._acc[k] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        self._acc[k].add_(p.grad.detach().reshape(-1))
        p.grad = None

    def _on_local_grad(self, k: int) -> None:
        if self.accumulate_fp32:
            self._fold(k)

    def _on_grad(self, k: int) -> None:
        if self._arrived[k]:
            self._deposit_again(k)
            return
        self._deposit(k)
        if self.overlap and self._next < self._frontier:  # most gradients complete no bucket
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < self._frontier:
            self._launch(self._next)
            self._next += 1

    def _launch(self, slot: int, late: Optional[torch.Tensor] = None) -> None:
        """Sends bucket `slot` (or its late second contributions, which add into the partition)."""
        g, b = self.order[slot]
        fresh = self._fresh[g] and late is None
        if late is None:
            buf = self._bucket(slot)
            self._bufs[slot] = None
        else:
            buf = late
        plan, world = self.plans[g], self.world_size  # chunk_range inlined (once per bucket per backward)
        start = plan.bucket_offset[b] // world
        end = start + plan.bucket_size[b] // world
        out = None
        part = self.grad_partitions[g]
        if fresh and self._into_partition and part is not None:  # the first round receives into the partition
            out = part[start:end]
        work, recv = self.strategy.reduce(buf, out)
        entry = _InFlight(g, b, work, buf, recv, start, end, fresh)
        if self.side_stream is None:
            if self.wait_each_bucket:  # overlap_comm false: the reduction completes before backward goes on
                self._finish_bucket(entry)
                return
            self._in_flight.append(entry)
            window = self.in_flight_window
            if window and len(self._in_flight) > window:
                self._finish_bucket(self._in_flight.pop(0))
            return
        # finish this bucket on the side stream right away (queued, not waited for), so its
        # device-to-host copy can run while backward goes on. The side stream first waits for the
        # compute stream, which zero-filled and wrote the bucket (and, at world size 1, nothing else
        # orders the two: no collective stands between them); the buffers it reads are recorded on
        # it, so the caching allocator does not hand them out again before it is done.
        self.side_stream.wait_stream(torch.cuda.current_stream())
        buf.record_stream(self.side_stream)
        recv.record_stream(self.side_stream)
        with torch.cuda.stream(self.side_stream):
            self._finish_bucket(entry)
        self._finished.append(entry)

    def _finish_bucket(self, e: _InFlight) -> None:
        """Waits for the bucket's collective (on the current stream) and folds the chunk into the
        partition, averaged; then hands the final chunk to on_bucket_final on the boundary."""
        if e.work is not None:
            e.work.wait()
        part = self.grad_partitions[e.g]
        if part is None:
            part = self._new_partition(e.g)
        dst = part[e.start:e.end]
        post = self._post
        if e.fresh:
            if e.recv.data_ptr() == dst.data_ptr():
                if post != 1.0:
                    dst.mul_(post)
            else:
                torch.mul(e.recv, post, out=dst)
        else:
            dst.add_(e.recv, alpha=post)
        if self._boundary and self.on_bucket_final is not None:
            self.on_bucket_final(e.g, e.start, e.end, dst)

    def _finish_round(self) -> None:
        # parameters whose hook did not fire this backward (unused, or grads from earlier micro-steps)
        for k in range(len(self._flat_params)):
            if not self._arrived[k]:
                self._deposit(k)
        self._launch_ready()
        late, self._late = self._late, {}
        for slot in sorted(late):
            self._launch(slot, late[slot])
        for entry in self._in_flight:
            self._finish_bucket(entry)
        self._in_flight = []
        if self.side_stream is not None:
            # later work on the current stream (the norm, freeing the buckets) comes after the side stream's
            torch.cuda.current_stream().wait_stream(self.side_stream)
        self._finished = []
        self._fresh = [False] * len(self.groups)
        self.rounds += 1

    def has_gradients(self) -> bool:
        return any(p is not None for p in self.grad_partitions)

    @torch.no_grad()
    def add_reduced(self, g: int, grad: torch.Tensor, start: int = 0, scale: float = 1.0) -> None:
        """Elements [start, start + grad.numel()) of group g's partition, reduced elsewhere (DeepCompile's
        reduce-scatter inside the compiled backward), times `scale` (the average's 1/world), added into the
        partition (zeros since the last clear before the first), and every parameter of the group counts as
        having had a gradient."""
        part = self.grad_partitions[g]
        if part is None:
            part = torch.zeros(self.plans[g].runtime_partition_size, dtype=self.comm_dtypes[g], device=grad.device)
            self.grad_partitions[g] = part
        part[start:start + grad.numel()].add_(grad.detach(), alpha=scale)
        self.touched.update(k for k, (gg, _) in enumerate(self._where) if gg == g)

    def remove(self) -> None:
        from deepspeed_c.runtime.zero import bucket_linear

        bucket_linear.uninstall(self.direct_linears, self._direct_sink)
        self.direct_linears, self._direct_sink = [], None
        super().remove()

    def clear(self) -> None:
        self.touched.clear()
        self._acc = [None] * len(self._flat_params)
        self.grad_partitions = [None] * len(self.groups)
        self._fresh = [True] * len(self.groups)

