"""`partition_activations` (with `cpu_checkpointing` and `contiguous_memory_optimization`): a checkpointed
segment's saved inputs split across the model-parallel group and gathered back for the recompute.

Under tensor parallelism every rank of a model-parallel group holds the same activations between layers, so
each rank keeps only its 1/mp slice of each floating-point input it saves (DeepSpeed's
`is_activation_to_checkpoint`: a float tensor with at least mp elements), optionally in host memory; the
backward all-gathers the slices over the model-parallel group before recomputing. Unlike DeepSpeed, an input
whose size does not divide by mp is padded, not truncated. `contiguous_memory_optimization` keeps the slices
of the i-th input of every checkpointed segment in one preallocated buffer of `number_checkpoints` slots
(fewer, larger allocations); the slots are reused once every segment's backward has run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Slice:
    """What a partitioned input needs to be rebuilt: its shape, dtype, device and grad flag."""
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def _mp(mpu: Any) -> tuple[Any, int, int]:
    return mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()


def _to_partition(t: torch.Tensor, size: int) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and t.numel() >= size


class ContiguousSlots:
    """Per input position, one buffer of `slots` equal slices; slot k of position i holds the i-th input of
    the k-th segment saved since the last time none was outstanding."""

    def __init__(self) -> None:
        self._buffers: list[Optional[torch.Tensor]] = []
        self._used: list[int] = []
        self.outstanding = 0

    def take(self, position: int, piece: torch.Tensor, slots: int) -> torch.Tensor:
        while len(self._buffers) <= position:
            self._buffers.append(None)
            self._used.append(0)
        buf = self._buffers[position]
        if buf is None or buf.shape[1:] != (piece.numel(),) or buf.dtype != piece.dtype or buf.device != piece.device:
            buf = self._buffers[position] = torch.empty((slots, piece.numel()), dtype=piece.dtype, device=piece.device)
            self._used[position] = 0
        k = self._used[position]
        if k >= buf.shape[0]:
            raise RuntimeError(f"contiguous_memory_optimization: more than number_checkpoints ({buf.shape[0]}) "
                               "checkpointed segments are waiting for their backward; raise "
                               "activation_checkpointing.number_checkpoints")
        self._used[position] = k + 1
        buf[k].copy_(piece.reshape(-1))
        return buf[k]

    def hold(self) -> None:
        """A segment's slices were taken: its backward will release them."""
        self.outstanding += 1

    def release(self) -> None:
        """A segment's backward ran; with none outstanding the slots start over."""
        self.outstanding = max(0, self.outstanding - 1)
        if self.outstanding == 0:
            self._used = [0] * len(self._used)


def partition(args: list[Any], mpu: Any, to_cpu: bool, contiguous: Optional[ContiguousSlots],
              slots: Optional[int]) -> tuple[list[Any], list[Optional[Slice]]]:
    """Each partitionable tensor of `args` replaced by this rank's slice (on the host with `to_cpu`)."""
    _, rank, size = _mp(mpu)
    saved: list[Any] = []
    meta: list[Optional[Slice]] = []
    position = 0
    for a in args:
        if not _to_partition(a, size):
            saved.append(a.detach().to("cpu") if to_cpu and torch.is_tensor(a) else a)
            meta.append(None)
            continue
        flat = a.detach().reshape(-1)
        per = -(-flat.numel() // size)
        piece = flat[rank * per:(rank + 1) * per]
        if piece.numel() < per:  # the last ranks' slices of an uneven input are padded with zeros
            piece = torch.cat([piece, piece.new_zeros(per - piece.numel())])
        if to_cpu:
            piece = piece.to("cpu")
        if contiguous is not None and slots:
            piece = contiguous.take(position, piece, slots)
        else:
            piece = piece.clone()
        position += 1
        saved.append(piece)
        meta.append(Slice(a.shape, a.dtype, a.device, a.requires_grad))
    if contiguous is not None:
        contiguous.hold()
    return saved, meta


def gather(saved: list[Any], meta: list[Optional[Slice]], mpu: Any) -> list[Any]:
    """The full inputs again: every rank's slices all-gathered over the model-parallel group."""
    import deepspeed_c.comm as dist

    group, _, size = _mp(mpu)
    out: list[Any] = []
    for piece, m in zip(saved, meta):
        if m is None:
            out.append(piece)
            continue
        piece = piece.to(m.device)
        parts = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(parts, piece.contiguous(), group=group)
        full = torch.cat(parts)[:m.shape.numel()].view(m.shape)
        out.append(full)
    return out
