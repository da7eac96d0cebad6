"""How a ZeRO optimizer (stages 1 and 2, and stage 3 which reuses it) turns this rank's reduced gradient
partitions into updated masters and model weights: one ZeroStepStrategy, chosen when the optimizer is
built.

- FusedEpilogueStep: fp32 masters on a CUDA device with Adam/AdamW. One epilogue kernel pass per
  bucket chunk unscales, clips, steps and writes the 16-bit copy; the norm stays on the device, so a
  bf16 step never waits for the host. Each chunk's all-gather goes out while the next steps.
- DeviceOptimizerStep: the separate passes. The reduced partitions become the masters' gradients (in
  the masters' dtype: fp32, or 16 bits under {bf16,fp16}_master_weights_and_grads), are unscaled and
  clipped by one coefficient, the wrapped optimizer steps, and the masters are written back.
- HostOffloadStep: offload_optimizer. The host side (offload.CPUOffload, or NVMe's subclass) steps in
  sub-chunks, each going back to the device and into its bucket's all-gather while the next steps.

Every strategy runs the one decision sequence (step_sequence.overflow_checked_step, through the
optimizer's `decide`), with the norm in the form its apply takes: a device scalar for the fused step,
a host float for the others."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.fused_epilogue import AdamEpilogue
from deepspeed_c.runtime.grad_norm import scale_
from deepspeed_c.runtime.step_sequence import Norm, StepOutcome
from deepspeed_c.runtime.zero.flat_model_params import FlatModelParams
from deepspeed_c.runtime.zero.grad_partition import chunk_range

# (partitions, on_device) -> the global L2 norm of the scaled gradient
GradNorm = Callable[[Sequence[torch.Tensor], bool], Norm]
# overflow_checked_step with the optimizer's scaler and clipping bound: (norm, apply_coef= | apply_fused=)
Decide = Callable[..., StepOutcome]


class ZeroStepStrategy(ABC):
    """One way of stepping; `epilogue` is the fused kernel when the strategy uses one."""

    epilogue: Optional[AdamEpilogue] = None

    @abstractmethod
    def step(self, parts: Sequence[torch.Tensor], *, clip_grad: float, grad_norm: GradNorm,
             decide: Decide) -> StepOutcome:
        """parts: each group's reduced gradient partition (runtime layout, on the model's device)."""

    def drop_scratch(self) -> None:
        """Forgets device buffers that are rebuilt on demand (after states moved between devices)."""


class FusedEpilogueStep(ZeroStepStrategy):

    def __init__(self, epilogue: AdamEpilogue, masters: Sequence[torch.nn.Parameter], plans: Sequence[PartitionPlan],
                 writer: Any, flat: Optional[FlatModelParams], *, rank: int, world_size: int,
                 lp_dtype: torch.dtype) -> None:
        self.epilogue = epilogue
        self.masters = masters  # the optimizer's list: the tensors keep their identity when their memory moves
        self.plans = plans
        self.writer = writer
        self.flat = flat
        self.rank = rank
        self.world_size = world_size
        self.lp_dtype = lp_dtype
        self.lp_out: Optional[list[torch.Tensor]] = None

    def use_slots(self, slots: Any) -> None:
        """Where each bucket's 16-bit output goes: anything with `own_slot(group, bucket, rank, world)` (stage 3's
        ShardSlots writes straight into the parameter shards instead of the flat model buffer)."""
        self.flat = slots

    def step(self, parts: Sequence[torch.Tensor], *, clip_grad: float, grad_norm: GradNorm,
             decide: Decide) -> StepOutcome:
        return decide(grad_norm(parts, True),
                      apply_fused=lambda norm, scale: self.apply(parts, norm, scale, clip_grad))

    def apply(self, parts: Sequence[torch.Tensor], norm: torch.Tensor, loss_scale: float, clip_grad: float) -> None:
        """Bucket by bucket: the epilogue steps the bucket's chunk of the partition, writing its 16-bit copy
        (into this rank's slot of the flat model buffer where there is one), and the chunk's all-gather
        goes out while the next chunk steps."""
        assert self.epilogue is not None
        sixteen = self.lp_dtype in (torch.float16, torch.bfloat16)
        for g, part in enumerate(parts):
            ranges = [chunk_range(self.plans[g], b, self.world_size) for b in range(self.plans[g].num_buckets)]
            master = self.masters[g].detach()
            outs = [self.lp_chunk(g, b, start, end) if sixteen else None for b, (start, end) in enumerate(ranges)]

            def gather(b: int, g: int = g, master: torch.Tensor = master, outs: list = outs,
                       ranges: list = ranges) -> None:
                chunk = outs[b]
                self.writer.submit(g, b, chunk if chunk is not None else master[slice(*ranges[b])])

            self.epilogue.step_ranges(g, part, ranges, outs, norm, loss_scale, clip_grad, gather)
        self.writer.finish()

    def lp_chunk(self, g: int, b: int, start: int, end: int) -> torch.Tensor:
        """Where the epilogue writes the 16-bit copy of bucket b's chunk: this rank's slot of the flat model
        buffer (its gather then runs in place), else a partition-sized scratch."""
        slot = None if self.flat is None else self.flat.own_slot(g, b, self.rank, self.world_size)
        if slot is not None:
            return slot
        if self.lp_out is None:
            self.lp_out = [torch.empty(m.numel(), dtype=self.lp_dtype, device=m.device) for m in self.masters]
        return self.lp_out[g][start:end]

    def drop_scratch(self) -> None:
        self.lp_out = None
        if self.epilogue is not None:
            self.epilogue.reset()


class DeviceOptimizerStep(ZeroStepStrategy):

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Sequence[torch.nn.Parameter],
                 write_back: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self.masters = masters
        self.write_back = write_back  # the updated masters into the model (all-gather, or stage 3's shards)

    def step(self, parts: Sequence[torch.Tensor], *, clip_grad: float, grad_norm: GradNorm,
             decide: Decide) -> StepOutcome:
        return decide(grad_norm(parts, False), apply_coef=lambda coef: self.apply(parts, coef))

    def apply(self, parts: Sequence[torch.Tensor], coef: float) -> None:
        grads = []
        for master, part in zip(self.masters, parts):
            master.grad = part.to(device=master.device, dtype=master.dtype)
            grads.append(master.grad)
        if coef != 1.0:
            scale_(grads, coef)
        self.optimizer.step()
        self.write_back()


class HostOffloadStep(ZeroStepStrategy):

    def __init__(self, offload: Any, writer: Any) -> None:
        self.offload = offload
        self.writer = writer

    def step(self, parts: Sequence[torch.Tensor], *, clip_grad: float, grad_norm: GradNorm,
             decide: Decide) -> StepOutcome:
        # host step in sub-chunks; each chunk goes back to the device and into its all-gather as it is done
        return decide(grad_norm(parts, False), apply_coef=lambda coef: self.offload.step(coef, self.writer, parts))
