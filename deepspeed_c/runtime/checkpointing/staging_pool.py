"""Host memory that a background checkpoint's tensors are staged into, kept from one save to the next.

A 1.3B-parameter ZeRO checkpoint is ~18 GB. Allocating (and, for the fast writer, pinning) that much host
memory on every save costs seconds, more than the copies themselves: fresh pages are faulted in one by one
and cudaHostAlloc registers each range with the driver. Saves of one run stage the same tensors in the same
order, so the pool walks the new save's tensors in order and hands back the previous save's buffer at the
same position when its shape and dtype still match (a new buffer otherwise). Device tensors are copied into
pinned buffers without blocking the host and synchronised once per staged file, so the copies of one file
overlap each other.

A buffer is reused only after the write that read it has finished: the writer calls `recycle()` once its
thread is joined, and stages nothing while a write runs."""
from __future__ import annotations

from typing import Any

import torch


class StagingPool:
    def __init__(self, shared: bool = False) -> None:
        self._shared = shared  # buffers in shared memory, handed to a writer process by handle
        self._free: list[torch.Tensor] = []  # the previous save's buffers, in the order they were handed out
        self._used: list[torch.Tensor] = []  # this save's buffers, in order
        self._cursor = 0

    def recycle(self) -> None:
        """The last save's write is done: its buffers become reusable, in the order they were staged."""
        self._free, self._used, self._cursor = self._used + self._free[self._cursor:], [], 0

    def drop(self) -> None:
        """Release every buffer (pinned memory is returned to torch's host allocator)."""
        self._free, self._used, self._cursor = [], [], 0

    def _buffer(self, like: torch.Tensor, pin: bool) -> torch.Tensor:
        if self._cursor < len(self._free):
            cand = self._free[self._cursor]
            if cand.shape == like.shape and cand.dtype == like.dtype and (self._shared or cand.is_pinned() == pin):
                self._cursor += 1
                self._used.append(cand)
                return cand
            # the layout changed (a different model or save): the rest of the old order is no guide
            self._free = self._free[:self._cursor]
        out = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin and not self._shared)
        if self._shared:
            out.share_memory_()
        self._used.append(out)
        return out

    def snapshot(self, obj: Any, pin: bool) -> Any:
        """`obj` with every tensor copied into a pool buffer, containers rebuilt. Returns after the copies
        are complete: training may change the originals as soon as this returns."""
        streams: set = set()
        out = self._copy(obj, pin, streams)
        for stream in streams:
            stream.synchronize()
        return out

    def _copy(self, obj: Any, pin: bool, streams: set) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            dst = self._buffer(src, pin and src.is_cuda)
            if src.is_cuda and dst.is_pinned():
                dst.copy_(src, non_blocking=True)
                streams.add(torch.cuda.current_stream(src.device))
            else:
                dst.copy_(src)
            return dst
        if isinstance(obj, dict):  # an OrderedDict stays one (DeepSpeed's param_shapes)
            return type(obj)((k, self._copy(v, pin, streams)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._copy(v, pin, streams) for v in obj]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(self._copy(v, pin, streams) for v in obj)
        return obj
