"""The collective step of one gradient bucket, chosen once per reducer.

The reducers (runtime/reducer.py at stage 0, runtime/zero/grad_partition.py at ZeRO 1/2/3) own the
round and arrival state machine: which bucket is ready, when it goes out, where the result lands.
What happens to a bucket that goes out is one call, `strategy.reduce(buf, out)`: scale by the pre
factor, start the collective, hand back (work to wait on, the tensor receiving this rank's result).
What the result must still be multiplied by is `strategy.post_factor`. Both factors, and which
collective runs, are fixed when the reducer is built, so the per-bucket path holds no branch on
the configuration (FSDP2 keeps its reduce-scatter behind a small strategy type the same way).

The factors follow DeepSpeed's gradient averaging: divide by the ranks that hold replicas (the world
over the sequence-parallel size under Ulysses, whose partial gradients add up), all of it after the
collective by default, part before it with gradient_predivide_factor, all before it with
prescale_gradients, none with gradient_allreduce_op "sum"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


@dataclass(frozen=True)
class ReduceFactors:
    pre: float   # applied to the bucket before the collective
    post: float  # applied to the received result after it


def averaging_factors(world_size: int, *, gradient_average: bool = True, prescale_gradients: bool = False,
                      gradient_predivide_factor: float = 1.0, sequence_parallel_size: int = 1) -> ReduceFactors:
    averaged = world_size / sequence_parallel_size
    if not gradient_average:  # gradient_allreduce_op "sum": a plain sum, no scaling either side
        return ReduceFactors(1.0, 1.0)
    if prescale_gradients:
        return ReduceFactors(1.0 / averaged, 1.0)
    return ReduceFactors(1.0 / gradient_predivide_factor, gradient_predivide_factor / averaged)


class BucketReduce:
    """One strategy: `reduce(buf, out)` scales `buf` by the pre factor in place and starts its collective.
    `out`, when given, is where this rank's reduced chunk should land (a reduce-scatter receives into
    it); strategies that produce their result elsewhere ignore it (`writes_out` False: a caller need
    not cut `out` for them). Returns (work or None, result)."""
    kind = "none"
    writes_out = False

    def __init__(self, factors: ReduceFactors) -> None:
        self.set_factors(factors)
        self.collectives = 0  # collectives issued, for tests and the benchmarks

    def set_factors(self, factors: ReduceFactors) -> None:
        """The scaling of the next reductions (engine.gradient_average assigned after initialize changes it)."""
        self.pre_factor = factors.pre
        self.post_factor = factors.post

    def _prescale(self, buf: torch.Tensor) -> None:
        if self.pre_factor != 1.0:
            buf.mul_(self.pre_factor)

    def reduce(self, buf: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple[Any, torch.Tensor]:
        raise NotImplementedError


class LocalReduce(BucketReduce):
    """One rank: nothing to exchange; the bucket is its own (whole) chunk."""
    kind = "local"

    def reduce(self, buf: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple[Any, torch.Tensor]:
        self._prescale(buf)
        return None, buf


class AllReduce(BucketReduce):
    """All-reduce the bucket in place. With `keep_rank` the result is that rank's 1/world chunk of it
    (ZeRO with reduce_scatter false: twice the bytes of a reduce-scatter); else the whole bucket."""
    kind = "all_reduce"

    def __init__(self, factors: ReduceFactors, group: Any, *, keep_rank: Optional[int] = None,
                 world_size: int = 1) -> None:
        super().__init__(factors)
        self.group = group
        self.keep_rank = keep_rank
        self.world_size = world_size

    def reduce(self, buf: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple[Any, torch.Tensor]:
        self._prescale(buf)
        work = _comm().all_reduce(buf, group=self.group, async_op=True)
        self.collectives += 1
        if self.keep_rank is None:
            return work, buf
        n = buf.numel() // self.world_size
        return work, buf[self.keep_rank * n:(self.keep_rank + 1) * n]


class ReduceScatter(BucketReduce):
    """Reduce-scatter the bucket into `out` (or a new chunk). With `average` NCCL divides by the world
    size while it loads the inputs (ReduceOp.AVG), so no pass over the result is left: post factor 1.
    deepspeed_c.comm serves it: once per unit in a ZeRO-3 backward, so its common path is the call
    prebuilt per group (comm/direct.py), with the comms logger, wrappers and fallbacks all kept."""
    kind = "reduce_scatter"
    writes_out = True

    def __init__(self, factors: ReduceFactors, group: Any, world_size: int, *, average: bool = False) -> None:
        super().__init__(ReduceFactors(factors.pre, 1.0) if average else factors)
        self.group = group
        self.world_size = world_size
        self.average = average
        self.op = torch.distributed.ReduceOp.AVG if average else torch.distributed.ReduceOp.SUM
        self._dist = _comm()  # the module: a function wrapped on it later (a collective counter) is still seen

    def reduce(self, buf: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple[Any, torch.Tensor]:
        if self.pre_factor != 1.0:
            buf.mul_(self.pre_factor)
        if out is None:
            out = torch.empty(buf.numel() // self.world_size, dtype=buf.dtype, device=buf.device)
        work = self._dist.reduce_scatter_tensor(out, buf, op=self.op, group=self.group, async_op=True)
        self.collectives += 1
        return work, out


class QuantizedReduceScatter(BucketReduce):
    """ZeRO++ qgZ (runtime/zero/zeropp.py): `reduce_fn(buf)` returns this rank's fp32 chunk of the sum
    through int4 all-to-alls, synchronously; it is copied into `out` (or a new chunk)."""
    kind = "quantized_reduce_scatter"
    writes_out = True

    def __init__(self, factors: ReduceFactors, reduce_fn: Callable[[torch.Tensor], torch.Tensor],
                 world_size: int) -> None:
        super().__init__(factors)
        self.reduce_fn = reduce_fn
        self.world_size = world_size

    def reduce(self, buf: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple[Any, torch.Tensor]:
        self._prescale(buf)
        if out is None:
            out = torch.empty(buf.numel() // self.world_size, dtype=buf.dtype, device=buf.device)
        out.copy_(self.reduce_fn(buf))
        self.collectives += 1
        return None, out


def nccl_can_average(factors: ReduceFactors, world_size: int, group: Any) -> bool:
    """Whether the reduce-scatter may average in NCCL itself instead of a separate pass over the partition
    after it (a read and write of every gradient element of this rank's partition each step). Only the
    plain average, the default (no pre-division, no sequence-parallel sum); gloo has no AVG."""
    plain = factors.pre == 1.0 and factors.post == 1.0 / world_size
    return plain and world_size > 1 and torch.distributed.get_backend(group) == "nccl"


def data_parallel_strategy(factors: ReduceFactors, group: Any) -> BucketReduce:
    """Stage 0: every bucket all-reduced whole (its post factor applied over all buckets at the end)."""
    return AllReduce(factors, group)


def partition_strategy(factors: ReduceFactors, *, rank: int, world_size: int, group: Any,
                       reduce_scatter: bool = True,
                       quantized_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> BucketReduce:
    """ZeRO 1/2/3: each bucket leaves this rank its 1/world chunk, reduced over `group`."""
    if world_size == 1:
        return LocalReduce(factors)
    if not reduce_scatter:  # DeepSpeed's zero_optimization.reduce_scatter false
        return AllReduce(factors, group, keep_rank=rank, world_size=world_size)
    if quantized_reduce is not None:
        return QuantizedReduceScatter(factors, quantized_reduce, world_size)
    return ReduceScatter(factors, group, world_size, average=nccl_can_average(factors, world_size, group))
