"""The graph operations of DeepCompile's ZeRO-3: gather a unit and reduce-scatter its gradient, registered
with torch.library so that dynamo, AOT autograd and inductor see them as opaque operators.

`dsc::z3_gather(chunk, handle, unit, prefetch)` returns the whole unit (every rank's chunk, in rank order);
its gradient is `dsc::z3_reduce_scatter(grad, handle, unit)`: this rank's chunk of the gradient summed over
the ranks, started asynchronously; the runner waits for it when autograd hands the chunk's gradient over
after the compiled backward, and divides by the ranks (DeepSpeed's gradient average). `handle` names a registered
Z3GraphContext (the process group and the store's shards live there: an operator schema carries no Python
objects). `prefetch`, set by the schedule pass per compiled graph, is the unit this call starts gathering
asynchronously for a later z3_gather of the same graph (-1: none); its result is taken when that call comes.
The last gather of a forward graph passes BACKWARD_FIRST: the unit the backward gathers first (as the last
backward did), when a backward will follow.

Releasing a unit is the end of its tensor's life: the gathered buffer is an intermediate of the graph that
inductor frees after its last reader, and the backward re-gathers it (the partition pass marks the gather
as recomputed), so no gathered unit is saved between forward and backward. Ordering: every rank compiles
the same graph the same way, so the collectives go out in one order on all ranks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_CONTEXTS: dict[int, "Z3GraphContext"] = {}
BACKWARD_FIRST = -2  # z3_gather's `prefetch` for the last gather of a forward graph: the backward's first unit


@dataclass
class Z3GraphContext:
    """What the ops of one engine's compiled graph need at run time."""
    group: Any
    world_size: int
    shards: list[torch.Tensor]  # per parameter group: this rank's flat shard (the store's)
    unit_of: list[tuple[int, int, int]]  # unit -> (group, chunk start, chunk end)
    pending: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)  # unit -> (buffer, work)
    reducing: dict[int, Any] = field(default_factory=dict)  # unit -> its gradient's reduce-scatter in flight
    gathers: int = 0
    reduces: int = 0
    prefetched: int = 0
    # counted when the ops run (a graph loaded from inductor's caches runs them without the passes):
    # z3_gather calls, and the gathers / prefetches of them issued while autograd runs a backward node
    # (the compiled backward's)
    gather_calls: int = 0
    backward_gathers: int = 0
    backward_prefetches: int = 0
    # across the forward/backward boundary: the unit the last backward gathered first (learned at run time:
    # the forward graph is compiled before the backward one), prefetched by the forward's last gather when
    # a backward will follow, so that all-gather overlaps the forward's tail and the loss instead of
    # stalling the backward's start
    first_backward_unit: int = -1
    expect_backward: bool = False
    _await_first_backward: bool = False

    def begin_forward(self, expect_backward: bool) -> None:
        """A forward call starts: a prefetch left from an earlier forward whose backward did not take it is
        dropped (the optimizer may have changed the shards since)."""
        self.drain()
        self.expect_backward = expect_backward
        self._await_first_backward = expect_backward

    def end_forward(self) -> None:
        """Waits for the prefetches nobody took, except the one kept for the backward's first gather."""
        keep = self.first_backward_unit if self.expect_backward else -1
        for unit in [u for u in self.pending if u != keep]:
            self.pending.pop(unit)[1].wait()

    def gather(self, chunk: torch.Tensor, unit: int) -> torch.Tensor:
        self.gather_calls += 1
        if torch._C._current_autograd_node() is not None:
            self.backward_gathers += 1
            if self._await_first_backward:
                self.first_backward_unit, self._await_first_backward = unit, False
        hit = self.pending.pop(unit, None)
        if hit is not None:
            buf, work = hit
            work.wait()
            return buf
        return self._start(chunk, unit, async_op=False)[0]

    def prefetch(self, unit: int) -> None:
        if unit == BACKWARD_FIRST:
            if not self.expect_backward or self.first_backward_unit < 0:
                return
            unit = self.first_backward_unit
        if unit in self.pending:
            return
        g, start, end = self.unit_of[unit]
        self.pending[unit] = self._start(self.shards[g][start:end], unit, async_op=True)
        self.prefetched += 1
        if torch._C._current_autograd_node() is not None:
            self.backward_prefetches += 1

    def _start(self, chunk: torch.Tensor, unit: int, async_op: bool) -> tuple[torch.Tensor, Any]:
        self.gathers += 1
        if self.world_size == 1:
            return chunk.detach().clone(), _Done()
        from deepspeed_c import comm

        buf = torch.empty(chunk.numel() * self.world_size, dtype=chunk.dtype, device=chunk.device)
        work = comm.all_gather_into_tensor(buf, chunk.detach().contiguous(), group=self.group, async_op=async_op)
        return buf, (work if async_op else _Done())

    def reduce_scatter(self, grad: torch.Tensor, unit: int) -> torch.Tensor:
        """Starts the sum over the ranks of this rank's chunk of the unit's gradient and returns the tensor
        it lands in; finish_reduce(unit) waits for it (the graph hands it out as the unit leaf's gradient,
        only read after the compiled backward returns, so backward compute overlaps the collective)."""
        self.reduces += 1
        if self.world_size == 1:
            return grad.clone()
        from deepspeed_c import comm

        out = torch.empty(grad.numel() // self.world_size, dtype=grad.dtype, device=grad.device)
        self.reducing[unit] = comm.reduce_scatter_tensor(out, grad.contiguous(), group=self.group, async_op=True)
        return out

    def finish_reduce(self, unit: int) -> None:
        work = self.reducing.pop(unit, None)
        if work is not None:
            work.wait()

    def drain(self) -> None:
        """Waits for prefetches nobody took (a graph left early) and unfinished reductions: a collective is
        never left behind."""
        for buf, work in self.pending.values():
            work.wait()
        self.pending.clear()
        for work in self.reducing.values():
            work.wait()
        self.reducing.clear()


class _Done:
    def wait(self) -> None:
        return None


def register_context(ctx: Z3GraphContext) -> int:
    handle = max(_CONTEXTS, default=-1) + 1
    _CONTEXTS[handle] = ctx
    return handle


def unregister_context(handle: int) -> None:
    ctx = _CONTEXTS.pop(handle, None)
    if ctx is not None:
        ctx.drain()


def context(handle: int) -> Z3GraphContext:
    # int(): dynamo may pass a handle that differed between two engines' traces as a symbolic int; this
    # specialises it (each engine's graph is its own)
    try:
        return _CONTEXTS[int(handle)]
    except KeyError:
        raise RuntimeError(f"DeepCompile: graph context {handle} is gone (its engine was destroyed); "
                           "a compiled graph outlived the engine that built it") from None


def _gather(chunk: torch.Tensor, handle: int, unit: int, prefetch: int) -> torch.Tensor:
    ctx = context(handle)
    out = ctx.gather(chunk, unit)
    if prefetch >= 0 or prefetch == BACKWARD_FIRST:
        ctx.prefetch(prefetch)
    return out


@torch.library.custom_op("dsc::z3_gather", mutates_args=())
def z3_gather(chunk: torch.Tensor, handle: int, unit: int, prefetch: int) -> torch.Tensor:
    return _gather(chunk, handle, unit, prefetch)


@z3_gather.register_fake
def _(chunk: torch.Tensor, handle: int, unit: int, prefetch: int) -> torch.Tensor:
    return chunk.new_empty(chunk.numel() * context(handle).world_size)


@torch.library.custom_op("dsc::z3_gather_after", mutates_args=())
def z3_gather_after(chunk: torch.Tensor, after: torch.Tensor, handle: int, unit: int, prefetch: int) -> torch.Tensor:
    """z3_gather that reads `after` (a reduce-scatter's result, unused): placed in a backward graph so that
    the scheduler issues that reduce-scatter, and computes the gradient it sends, before this gather; inductor
    otherwise fused the equal-sized gradient assemblies of several units into one kernel and sent their
    reduce-scatters together at the backward's end, where nothing overlaps them."""
    return _gather(chunk, handle, unit, prefetch)


@z3_gather_after.register_fake
def _(chunk: torch.Tensor, after: torch.Tensor, handle: int, unit: int, prefetch: int) -> torch.Tensor:
    return chunk.new_empty(chunk.numel() * context(handle).world_size)


@torch.library.custom_op("dsc::z3_reduce_scatter", mutates_args=())
def z3_reduce_scatter(grad: torch.Tensor, handle: int, unit: int) -> torch.Tensor:
    return context(handle).reduce_scatter(grad, unit)


@z3_reduce_scatter.register_fake
def _(grad: torch.Tensor, handle: int, unit: int) -> torch.Tensor:
    return grad.new_empty(grad.numel() // context(handle).world_size)


def _gather_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.handle, ctx.unit = inputs[1], inputs[2]


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
    return torch.ops.dsc.z3_reduce_scatter(grad, ctx.handle, ctx.unit), None, None, None


z3_gather.register_autograd(_gather_backward, setup_context=_gather_setup)

GATHER = torch.ops.dsc.z3_gather.default
GATHER_AFTER = torch.ops.dsc.z3_gather_after.default
REDUCE_SCATTER = torch.ops.dsc.z3_reduce_scatter.default


def contexts() -> list[Z3GraphContext]:
    """The live graph contexts (one per engine compiled with DeepCompile at ZeRO-3), oldest first."""
    return [_CONTEXTS[h] for h in sorted(_CONTEXTS)]
