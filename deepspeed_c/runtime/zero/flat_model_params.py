"""ZeRO-1/2's 16-bit model parameters as views of one flat buffer per parameter group, laid out as the
group's partition plan (runtime layout), as DeepSpeed's bit16_groups_flat.

With the parameters inside the buffer, a bucket's all-gather writes the updated weights straight into
the model: no gather buffer, no copy out of it; and the optimizer epilogue can write this rank's
16-bit chunk into its own slot of the bucket, so the all-gather runs in place. A group qualifies when
its parameters are plain tensors sharing one dtype and device. Anything that later re-points a
parameter's `.data` (offload_states, a dtype change, a load that assigns instead of copying) is noticed
before the next gather, and the group is flattened again from the parameters' current values."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from deepspeed_c.ops.partition import PartitionPlan


class FlatModelParams:

    def __init__(self, plans: Sequence[PartitionPlan], groups: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        self.plans = list(plans)
        self.groups = [list(g) for g in groups]
        self.buffers: list[Optional[torch.Tensor]] = [None] * len(self.groups)
        self._ptrs: list[list[int]] = [[] for _ in self.groups]

    @staticmethod
    def _eligible(params: Sequence[torch.nn.Parameter]) -> bool:
        if not params:
            return False
        dtype, device = params[0].dtype, params[0].device
        # tensor subclasses (DTensor, quantized weights) keep their own storage
        return device.type != "meta" and all(
            type(p.data) is torch.Tensor and p.dtype == dtype and p.device == device and p.layout == torch.strided
            for p in params)

    def _aliased(self, g: int) -> bool:
        ptrs = self._ptrs[g]
        return self.buffers[g] is not None and [p.data_ptr() for p in self.groups[g]] == ptrs

    @torch.no_grad()
    def ensure(self) -> None:
        """Every qualifying group's parameters are views of its flat buffer (re-flattened if moved)."""
        for g, params in enumerate(self.groups):
            if self._aliased(g):
                continue
            self.buffers[g] = None
            self._ptrs[g] = []
            if not self._eligible(params):
                continue
            plan = self.plans[g]
            flat = torch.zeros(plan.runtime_total, dtype=params[0].dtype, device=params[0].device)
            for p, off in zip(params, plan.param_offset):
                view = flat[off:off + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
            self.buffers[g] = flat
            self._ptrs[g] = [p.data_ptr() for p in params]

    def drop(self) -> None:
        """Forget the buffers (the parameters were moved elsewhere); the next ensure() rebuilds them."""
        self.buffers = [None] * len(self.groups)
        self._ptrs = [[] for _ in self.groups]

    def bucket(self, g: int, b: int) -> Optional[torch.Tensor]:
        """Bucket b of group g inside the flat buffer (None: the group is not flat)."""
        flat = self.buffers[g]
        if flat is None:
            return None
        start = self.plans[g].bucket_offset[b]
        return flat[start:start + self.plans[g].bucket_size[b]]

    def own_slot(self, g: int, b: int, rank: int, world_size: int) -> Optional[torch.Tensor]:
        """This rank's chunk of bucket b: where its updated 16-bit weights go before an in-place gather."""
        full = self.bucket(g, b)
        if full is None:
            return None
        n = full.numel() // world_size
        return full[rank * n:(rank + 1) * n]
