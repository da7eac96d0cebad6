"""The swap-in buffers of ZeRO-3 parameters on NVMe (`offload_param.buffer_count` x `buffer_size`).

A fixed pool of host buffers, allocated once: a unit read from its swap file lands in one of them and
stays there until its gather has consumed it. The pool is the bound on host memory holding swapped-in
parameter partitions: at most `count` buffers of `numel` elements are ever allocated, each no larger
than `buffer_size` (a buffer is sized to the largest unit that will use it, so a small model does not
pay DeepSpeed's default 5 x 1e8 elements). Pinned when asked and CUDA is there (the copy to the
device then runs at full speed), else ordinary page-aligned memory."""
from __future__ import annotations

import os
from typing import Optional

import torch
from deepspeed_c.accelerator.host_memory import host_empty


class SwapInBuffers:

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.count, self.numel, self.dtype = int(count), int(numel), dtype
        pin = pin and torch.cuda.is_available()
        self.buffers = [host_empty(self.numel, dtype, pin) for _ in range(self.count)]
        self.free: list[int] = list(range(self.count - 1, -1, -1))
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds (all of it, allocated at start)."""
        return self.count * self.numel * torch.empty((), dtype=self.dtype).element_size()

    def acquire(self) -> Optional[int]:
        """A free buffer's index, or None when every buffer holds a unit."""
        if not self.free:
            return None
        b = self.free.pop()
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return b

    def release(self, b: int) -> None:
        self.free.append(b)
        self.in_use -= 1

    def view(self, b: int, n: int) -> torch.Tensor:
        return self.buffers[b][:n]


def read_into(fd: int, dst: torch.Tensor, offset: int, path: str) -> None:
    """dst's bytes from file `fd` at byte `offset` (through the page cache, coherent with the file's mapping;
    the read-ahead hint given when the fetch was planned has usually brought them in already)."""
    view = memoryview(dst.view(torch.uint8).numpy()).cast("B")
    done, total = 0, view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: short read at byte {offset + done} ({total - done} bytes missing)")
        done += n
