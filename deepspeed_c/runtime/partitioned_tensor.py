"""deepspeed.runtime.utils.PartitionedTensor: a tensor split into near-equal flat slices over a process
group (each rank keeps its own slice), with a long-tensor `meta` that lets a receiver rebuild the same
object from its local slice (`from_meta`) and gather the whole tensor back (`full`). Megatron-DeepSpeed's
pipeline engines (its zero-bubble schedule) import it; DeepSpeed's pipeline uses it to ship activations
split over the tensor-parallel group. Its collectives go through deepspeed_c.comm (counted by the comms logger)."""
from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

import deepspeed_c.comm as dist


def _device_name() -> str:
    from deepspeed_c.accelerator import get_accelerator

    return get_accelerator().device_name()


class PartitionedTensor:
    """`tensor` split over `group`: rank r keeps elements partition[r]:partition[r+1] of its flat view."""

    def __init__(self, tensor: torch.Tensor, group: Any, partition_meta: Any = None) -> None:
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device: Union[str, torch.device] = tensor.device
        from deepspeed_c.runtime.pipe.partition import partition_uniform

        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        lo, hi = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[lo:hi].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Optional[Union[str, torch.device]] = None) -> "PartitionedTensor":
        """The PartitionedTensor whose `to_meta()` was `meta`, holding `local_part` as this rank's slice."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a torch.long tensor, got {meta.dtype}")
        obj = cls(torch.ones(dist.get_world_size(group=group)), group)
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        obj.orig_size = values[1:1 + ndim]
        num_parts, rank = values[1 + ndim], values[2 + ndim]
        if num_parts != obj.num_parts or rank != obj.rank:
            raise ValueError(f"PartitionedTensor.from_meta: meta was written for part {rank} of {num_parts}, this "
                             f"rank is part {obj.rank} of {obj.num_parts}")
        obj.partition = values[3 + ndim:]
        obj.orig_device = device if device is not None else _device_name()
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's slice (a collective over the group)."""
        flat = torch.zeros(math.prod(self.orig_size), dtype=self.local_data.dtype,
                           device=device if device is not None else self.orig_device)
        if self.even_split:
            dist.all_gather_into_tensor(flat, self.local_data.to(flat.device), group=self.group)
        else:  # unequal slices: each owner broadcasts its own into place
            for part in range(self.num_parts):
                lo, hi = self.partition[part], self.partition[part + 1]
                buf = flat[lo:hi]
                if part == self.rank:
                    buf.copy_(self.local_data)
                dist.broadcast(buf, dist.get_global_rank(self.group, part) if self.group is not None else part,
                               group=self.group)
        return flat.view(self.orig_size).clone().detach()

    def to_meta(self) -> torch.Tensor:
        """[ndim, *size, num_parts, rank, *partition] as a long tensor on the original device."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list:
        return self.orig_size
