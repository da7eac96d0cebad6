"""ZeRO-Offload for stages 1 and 2 (`offload_optimizer: {device: cpu}`): the fp32 master partition
and the optimizer states live in host memory and the C CPU optimizer steps them.

The pipeline, per step, on a GPU:
1. backward: as each bucket's reduce-scatter finishes, its averaged chunk is copied to a pinned
   host buffer on a side stream (`bucket_sink()` and `stream`, which the optimizer hands the gradient
   partitioner, grad_partition.ZeroGradPartitioner, when it builds it), while backward goes on;
2. step: the host waits only for copies still running, then steps the partition in sub-chunks
   (`sub_chunk` elements) with the C kernel, which reads 16-bit gradients directly and writes the
   updated weights in the model's dtype into a pinned buffer in the same pass; each sub-chunk is
   copied to the device on the side stream as soon as it is written, while the CPU steps the next;
3. a bucket whose chunk has arrived is all-gathered at once (param_gather.BucketGatherer).
On a CPU-only run the partition already is host memory: no copies, and step 3 still overlaps the
CPU step with the (asynchronous) all-gathers.

`stats` counts how long the host waited for device-to-host copies at the step, how long the CPU
step took, how long the all-gather tail took after it, and (GPU) the copies' own durations from
CUDA events, so a run can say how much of the copying was hidden. Optimizers other than the C CPU
ones (zero_force_ds_cpu_optimizer=false) step the whole partition at once: the same copies, no
sub-chunk overlap."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_empty
from deepspeed_c.runtime.zero.param_gather import BucketGatherer

SUB_CHUNK = 1 << 22  # elements per C-kernel call / host-to-device copy in the pipelined step


@dataclass
class OffloadStats:
    steps: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_wait_s: float = 0.0  # host blocked at step() on device-to-host copies
    cpu_step_s: float = 0.0  # the CPU optimizer over the partition (H2D copies and gathers run meanwhile)
    tail_s: float = 0.0  # after the CPU step: waiting for the last copies and all-gathers
    d2h_copy_ms: float = 0.0  # sum of the device-to-host copies' own durations (CUDA events)
    h2d_copy_ms: float = 0.0
    _events: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False)

    def record_copy(self, kind: str, start: Any, end: Any) -> None:
        """A copy ("d2h" or "h2d") bracketed by two recorded CUDA events; timed at the next collect()."""
        self._events.append((kind, start, end))

    def collect(self) -> None:
        """Folds the finished copies' CUDA event timings into the totals (synchronises them)."""
        for kind, start, end in self._events:
            end.synchronize()
            ms = start.elapsed_time(end)
            if kind == "d2h":
                self.d2h_copy_ms += ms
            else:
                self.h2d_copy_ms += ms
        self._events = []

    def as_dict(self) -> dict[str, float]:
        self.collect()
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class CPUOffload:
    """Host buffers, the side stream and the pipelined host step of one ZeRO optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor],
                 groups: Sequence[Sequence[torch.nn.Parameter]], grad_dtypes: Sequence[torch.dtype],
                 chunk_ranges: Sequence[Sequence[tuple[int, int]]], *,
                 stage_on_host: Optional[bool] = None, sub_chunk: int = SUB_CHUNK, pin_memory: bool = True,
                 threads: Optional[int] = None) -> None:
        """`grad_dtypes`: each group's reduced-gradient dtype; `chunk_ranges[g][b]`: [start, end) of bucket
        b's chunk in this rank's partition of group g (the order the gathers go out in)."""
        from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase

        self.optimizer = optimizer
        self.masters = list(masters)
        self.grad_dtypes = list(grad_dtypes)
        self.chunk_ranges = [list(r) for r in chunk_ranges]
        self.device = groups[0][0].device
        self.cuda = self.device.type == "cuda"
        self.sub_chunk = max(1, int(sub_chunk))
        self.lp_dtypes = [params[0].dtype for params in groups]
        self.fused = isinstance(optimizer, CPUOptimizerBase)
        if threads is not None and self.fused:  # offload_optimizer.cpuadam_cores_perc
            optimizer.ds_opt_op.num_threads(int(threads))
        # a separate host copy of the gradients: needed when they are reduced on a GPU; forced on a
        # CPU-only run by tests, to exercise the per-bucket staging
        self.staging = self.cuda if stage_on_host is None else bool(stage_on_host)
        # pinned staging makes the copies asynchronous; offload_optimizer.pin_memory=false (e.g. under a
        # locked-memory limit) keeps pageable buffers, whose copies block the host instead
        pin = self.cuda and pin_memory
        sizes = [m.numel() for m in self.masters]
        self.sizes = sizes  # kept: an NVMe subclass empties the masters between steps
        self.host_grads: list[Optional[torch.Tensor]] = [
            host_empty(n, self.grad_dtypes[g], pin) if self.staging else None
            for g, n in enumerate(sizes)]
        # the model-dtype result of the step, in host memory, read by the copy to the device (pinned,
        # so that copy is asynchronous); an fp32 model on a CPU-only run gathers the master itself
        self.host_lp: list[Optional[torch.Tensor]] = []
        for m, dt in zip(self.masters, self.lp_dtypes):
            direct = dt == torch.float32 and (not self.cuda or m.is_pinned())
            self.host_lp.append(None if direct else host_empty(m.numel(), dt, pin))
        self._staged = [0] * len(sizes)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last_d2h: Any = None
        self._last_h2d: Any = None
        self.stats = OffloadStats()

    def bucket_sink(self) -> Optional[Callable[[int, int, int, torch.Tensor], None]]:
        """What the gradient partitioner calls (on `stream`, on the accumulation boundary) with each final
        chunk of the reduced partition: its copy to the host. None when nothing is staged on the host."""
        return self._stage_chunk if self.staging else None

    def resident(self) -> contextlib.AbstractContextManager:
        """Masters and optimizer state are in host memory already (NVMeOffload reads them back)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """The optimizer is destroyed (NVMeOffload removes its swap files)."""

    def reset(self) -> None:
        """Gradients dropped (zero_grad, a skipped step): nothing staged for the next step yet."""
        self._staged = [0] * len(self.masters)

    # -- backward: gradients to the host, bucket by bucket ----------------------------------------------
    def _event(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _stage_chunk(self, g: int, start: int, end: int, chunk: torch.Tensor) -> None:
        """Runs on the side stream (GPU) as soon as `chunk`, [start, end) of group g's partition, is final."""
        host = self.host_grads[g]
        assert host is not None
        if self.cuda:
            t0 = self._event()
            host[start:end].copy_(chunk, non_blocking=True)
            t1 = self._event()
            self.stats.record_copy("d2h", t0, t1)
            self._last_d2h = t1
        else:
            host[start:end].copy_(chunk)
        self._staged[g] += end - start
        self.stats.d2h_bytes += (end - start) * host.element_size()

    def _host_grads(self, parts: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        """Every group's reduced gradient partition (`parts`, on the device) in host memory, complete."""
        t0 = time.perf_counter()
        if self._last_d2h is not None:
            self._last_d2h.synchronize()
            self._last_d2h = None
        out = []
        for g, m in enumerate(self.masters):
            part = parts[g]
            if not self.staging:
                out.append(part if part is not None else torch.zeros(self.sizes[g], dtype=self.grad_dtypes[g]))
                continue
            host = self.host_grads[g]
            assert host is not None
            if part is None:
                host.zero_()
            elif self._staged[g] != self.sizes[g]:  # not (all) staged during backward: copy now
                host.copy_(part)
                self.stats.d2h_bytes += host.numel() * host.element_size()
            out.append(host)
        self._staged = [0] * len(self.masters)
        self.stats.d2h_wait_s += time.perf_counter() - t0
        return out

    # -- step: C CPU optimizer in sub-chunks, each copied to the device as it is done ------------------
    @torch.no_grad()
    def step(self, coef: float, gatherer: BucketGatherer, parts: Sequence[Optional[torch.Tensor]]) -> None:
        grads = self._host_grads(parts)
        if self._last_h2d is not None:  # the pinned lp buffers are about to be rewritten
            self._last_h2d.synchronize()
            self._last_h2d = None
        self.stats.collect()
        t0 = time.perf_counter()
        dev_lps: list[Optional[torch.Tensor]] = [None] * len(self.masters)
        if self.cuda:
            # the device copies of the updated weights: allocated before the side stream waits for the
            # compute stream, since their memory may have been in use there until now
            dev_lps = [torch.empty(n, dtype=dt, device=self.device) for n, dt in zip(self.sizes, self.lp_dtypes)]
            self.stream.wait_stream(torch.cuda.current_stream())
        if not self.fused:
            self._step_whole(grads, coef)
        for g, master in enumerate(self.masters):
            self._step_group(g, master, grads[g], coef, gatherer, dev_lps[g])
        t1 = time.perf_counter()
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self._last_h2d = self._event()
        gatherer.finish()
        self.stats.cpu_step_s += t1 - t0
        self.stats.tail_s += time.perf_counter() - t1
        self.stats.steps += 1

    def _step_whole(self, grads: list[torch.Tensor], coef: float) -> None:
        """A torch optimizer on host tensors: fp32 gradients attached, one step over everything."""
        for master, grad in zip(self.masters, grads):
            grad32 = grad.float() if grad.dtype != torch.float32 else grad
            if coef != 1.0:
                grad32 = grad32.mul(coef) if grad32 is grad else grad32.mul_(coef)
            master.grad = grad32 if master.dtype == torch.float32 else grad32.to(master.dtype)
        self.optimizer.step()
        for master in self.masters:
            master.grad = None

    def _step_group(self, g: int, master: torch.Tensor, grad: torch.Tensor, coef: float, gatherer: BucketGatherer,
                    dev_lp: Optional[torch.Tensor]) -> None:
        opt = self.optimizer
        group = opt.param_groups[g]
        lp = self.host_lp[g]
        src = lp if lp is not None else master.detach()
        step, state = 0, None
        if self.fused:
            state = opt.ready_state(group, master, f"params[{g}][0]")
            step = int(opt.ds_opt_op.bump_steps([state["step"]])[0])
        try:
            for b, (start, end) in enumerate(self.chunk_ranges[g]):
                for lo in range(start, end, self.sub_chunk):
                    hi = min(end, lo + self.sub_chunk)
                    if self.fused:
                        self._kernel(group, state, master, grad, lp, lo, hi, coef, step)
                    elif lp is not None:
                        lp[lo:hi].copy_(master.detach()[lo:hi])
                    if dev_lp is not None:
                        self._to_device(dev_lp[lo:hi], src[lo:hi])
                self._submit_bucket(gatherer, g, b, start, end, src, dev_lp)
        except Exception:
            if state is not None:
                state["step"] -= 1
            raise

    def _submit_bucket(self, gatherer: BucketGatherer, g: int, b: int, start: int, end: int, src: torch.Tensor,
                       dev_lp: Optional[torch.Tensor]) -> None:
        """Bucket b of group g to its gather: the device copy once the side stream's copies into it have landed
        (dev_lp), else the host values."""
        if dev_lp is None:
            gatherer.submit(g, b, src[start:end])
            return
        with torch.cuda.stream(self.stream):
            arrived = torch.cuda.Event()
            arrived.record()
        torch.cuda.current_stream().wait_event(arrived)
        gatherer.submit(g, b, dev_lp[start:end])

    def _kernel(self, group: dict[str, Any], state: Any, master: torch.Tensor, grad: torch.Tensor,
                lp: Optional[torch.Tensor], lo: int, hi: int, coef: float, step: int) -> None:
        moments = [[state[k][lo:hi]] for k in self.optimizer.MOMENTS]
        copies = None if lp is None else [lp[lo:hi]]
        if folds_coef(self.optimizer, master.dtype):  # the kernel scales as it reads: no scaled copy, grad kept
            self.optimizer.step_tensors(group, [master.detach()[lo:hi]], [grad[lo:hi]], moments, copies, step,
                                        grad_scale=coef)
            return
        g = unscaled_grad(grad[lo:hi], coef, master.dtype)
        self.optimizer.step_tensors(group, [master.detach()[lo:hi]], [g], moments, copies, step)

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            t0 = self._event()
            dst.copy_(src, non_blocking=True)
            t1 = self._event()
        self.stats.record_copy("h2d", t0, t1)
        self.stats.h2d_bytes += src.numel() * src.element_size()


def folds_coef(optimizer: Any, master_dtype: torch.dtype) -> bool:
    """Whether the optimizer's C kernel applies the coefficient itself, bit for bit as unscaled_grad would
    (an fp32 multiply; with a 16-bit master unscaled_grad also rounds the scaled gradient to its dtype)."""
    return bool(getattr(optimizer, "FOLDS_GRAD_SCALE", False)) and master_dtype == torch.float32


def unscaled_grad(g: torch.Tensor, coef: float, master_dtype: torch.dtype) -> torch.Tensor:
    """A gradient slice times coef (loss-scale and clip factor), in the master's dtype."""
    if coef == 1.0:
        return g
    # unscale (and clip) in fp32, as DeepSpeed does: in fp16 a loss-scaled tiny gradient
    # flushes to zero or loses precision once divided by the scale
    g = g.float().mul_(coef) if g.dtype != torch.float32 else g.mul_(coef)
    if master_dtype != torch.float32:  # 16-bit masters (*_master_weights_and_grads) take 16-bit grads
        g = g.to(master_dtype)
    return g
