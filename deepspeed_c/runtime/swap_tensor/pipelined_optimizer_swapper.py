"""ZeRO-Infinity's optimizer step (`offload_optimizer: {device: nvme}`): ZeRO-Offload's host step
(runtime/zero/offload.CPUOffload: gradients staged to the host, the C CPU optimizer, updated weights
back to the device and into their buckets' all-gathers) with the fp32 masters and moments read from
and written to files sub-group by sub-group.

Per group, with two or more slots (buffer_count of 8 or more for Adam: see partitioned_optimizer_swapper): the
read of sub-group s+1 is in flight while the C kernel steps sub-group s, and the write of sub-group s-1 (and
earlier) drains meanwhile (DeepSpeed's pipeline_read and pipeline_write); one slot (DeepSpeed's default
buffer_count 4) runs read, step, write in turn. A bucket's all-gather starts as soon as the sub-groups covering its chunk are done.
The kernel and its arguments are CPUOffload's, so the run matches `device: cpu` bit for bit."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_empty
from deepspeed_c.runtime.swap_tensor.aio_config import AioConfig
from deepspeed_c.runtime.swap_tensor.partitioned_optimizer_swapper import MASTER, PartitionedOptimizerSwapper
from deepspeed_c.runtime.zero.offload import CPUOffload, folds_coef, unscaled_grad
from deepspeed_c.runtime.zero.param_gather import BucketGatherer


class NVMeOffload(CPUOffload):
    """CPUOffload whose masters and optimizer moments live in files under nvme_path."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor],
                 groups: Sequence[Sequence[torch.nn.Parameter]], grad_dtypes: Sequence[torch.dtype],
                 chunk_ranges: Sequence[Sequence[tuple[int, int]]], *, nvme_path: str,
                 stage: int, rank: int, aio: AioConfig, buffer_count: int, sub_group_size: int,
                 **cpu_offload_args: Any) -> None:
        super().__init__(optimizer, masters, groups, grad_dtypes, chunk_ranges, **cpu_offload_args)
        if not self.fused:
            raise ValueError(f"zero_optimization.offload_optimizer.device 'nvme' steps the optimizer sub-group by "
                             f"sub-group with a DeepSpeed CPU optimizer (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, "
                             f"DeepSpeedCPULion); got {type(optimizer).__name__}")
        pin = self.cuda and bool(cpu_offload_args.get("pin_memory", True))
        # the master is not in memory to gather from: every group gets a model-dtype output buffer
        for g, m in enumerate(self.masters):
            if self.host_lp[g] is None:
                self.host_lp[g] = host_empty(m.numel(), self.lp_dtypes[g], pin)
        self.swapper = PartitionedOptimizerSwapper(self.masters, optimizer, nvme_path=nvme_path, stage=stage,
                                                   rank=rank, aio=aio, buffer_count=buffer_count,
                                                   sub_group_size=sub_group_size)

    def resident(self) -> contextlib.AbstractContextManager:
        return self.swapper.resident()

    def close(self) -> None:
        self.swapper.close()

    def _step_group(self, g: int, master: torch.Tensor, grad: torch.Tensor, coef: float, gatherer: BucketGatherer,
                    dev_lp: Optional[torch.Tensor]) -> None:
        opt, sw = self.optimizer, self.swapper
        group = opt.param_groups[g]
        state = sw.group_state(g)
        step = int(opt.ds_opt_op.bump_steps([state["step"]])[0])
        buckets = self.chunk_ranges[g]
        lp = self.host_lp[g]
        assert lp is not None
        try:
            done = 0  # buckets submitted
            for s, (lo, hi), views in self._stream(g):
                for a in range(lo, hi, self.sub_chunk):
                    b = min(hi, a + self.sub_chunk)
                    self._kernel_on(group, views, lo, grad, lp, a, b, coef, step, master.dtype)
                    if dev_lp is not None:
                        self._to_device(dev_lp[a:b], lp[a:b])
                sw.write_async(views, g, s)
                while done < len(buckets) and buckets[done][1] <= hi:
                    self._submit_bucket(gatherer, g, done, *buckets[done], lp, dev_lp)
                    done += 1
            for b in range(done, len(buckets)):
                self._submit_bucket(gatherer, g, b, *buckets[b], lp, dev_lp)
            sw.write_handle.wait()
        except BaseException:
            state["step"] -= 1
            _drain(sw)
            raise

    def _stream(self, g: int) -> Iterator[tuple[int, tuple[int, int], dict[str, torch.Tensor]]]:
        """Sub-groups of group g in their slots, each read before it is handed out; the next one's
        read is issued before this one is stepped when another slot is free."""
        sw = self.swapper
        bounds = sw.bounds[g]
        nb = sw.slot_count
        written: set[int] = set()  # slots whose write may still be in flight
        views = sw.read_async(0, g, 0)
        for s, bound in enumerate(bounds):
            sw.read_handle.wait()
            cur = views
            ahead = nb > 1 and s + 1 < len(bounds)
            if ahead:
                nxt = (s + 1) % nb
                if nxt in written:
                    sw.write_handle.wait()
                    written.clear()
                views = sw.read_async(nxt, g, s + 1)
            yield s, bound, cur
            written.add(s % nb)
            if not ahead and s + 1 < len(bounds):  # one slot: its write must land before the next read
                sw.write_handle.wait()
                written.clear()
                views = sw.read_async((s + 1) % nb, g, s + 1)

    def _kernel_on(self, group: dict[str, Any], views: dict[str, torch.Tensor], base: int, grad: torch.Tensor,
                   lp: torch.Tensor, a: int, b: int, coef: float, step: int, master_dtype: torch.dtype) -> None:
        """CPUOffload._kernel's arithmetic on a slot's tensors (the sub-group starts at `base`)."""
        moments = [[views[k][a - base:b - base]] for k in self.optimizer.MOMENTS]
        if folds_coef(self.optimizer, master_dtype):  # the kernel scales as it reads: no scaled copy
            self.optimizer.step_tensors(group, [views[MASTER][a - base:b - base]], [grad[a:b]], moments, [lp[a:b]],
                                        step, grad_scale=coef)
            return
        g = unscaled_grad(grad[a:b], coef, master_dtype)
        self.optimizer.step_tensors(group, [views[MASTER][a - base:b - base]], [g], moments, [lp[a:b]], step)


def _drain(sw: PartitionedOptimizerSwapper) -> None:
    """After a failure: let every op in flight finish before the slots can be reused."""
    for h in (sw.read_handle, sw.write_handle):
        try:
            h.wait()
        except OSError:
            pass
