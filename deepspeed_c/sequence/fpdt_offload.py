"""Host offload of FPDT chunks: each chunk's tensor lives in a host buffer while it is not being computed
on, and is brought back one step ahead of its use (double buffering), so at most the chunk in use and
the one being prefetched occupy the device.

On a GPU the copies run on one side CUDA stream into/out of pinned host buffers: an offload waits (by
event) for the kernel that produced the tensor, and the device copy is kept alive for the side stream
(record_stream) until the copy is done; a prefetch records an event the compute stream waits on before
the first use. On the host the "offload" is a plain copy into a separate host buffer (the same
bookkeeping, which the CPU tests exercise), and a prefetch copies it back.

With offloading off the store simply keeps the tensors where they are."""
from __future__ import annotations

from typing import Dict, Hashable, Optional

import torch
from torch import Tensor


class ChunkStore:
    """Chunks by key; get() returns the device tensor, prefetch() starts bringing one in ahead of time."""

    def __init__(self, device: torch.device, offload: bool) -> None:
        self.device = torch.device(device)
        self.offload = offload
        self.cuda = offload and self.device.type == "cuda"
        self._host: Dict[Hashable, Tensor] = {}
        self._resident: Dict[Hashable, Tensor] = {}
        self._ready: Dict[Hashable, "torch.cuda.Event"] = {}
        self._stream: Optional["torch.cuda.Stream"] = torch.cuda.Stream(self.device) if self.cuda else None
        self.peak_resident = 0  # most chunks on the device at once (the double buffer's bound, when offloading)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._host or key in self._resident

    def put(self, key: Hashable, t: Tensor, keep: bool = False) -> None:
        """Store t under key (replacing any earlier value); keep=True leaves it resident for immediate use."""
        if not self.offload:
            self._resident[key] = t
            self.peak_resident = max(self.peak_resident, len(self._resident))
            return
        host = self._host.get(key)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)
            self._host[key] = host
        if self.cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self._stream)  # the allocator must not hand t's memory out before the copy ends
        else:
            host.copy_(t)
        if keep:
            self._resident[key] = t
            self.peak_resident = max(self.peak_resident, len(self._resident))
        else:
            self._resident.pop(key, None)
            self._ready.pop(key, None)

    def prefetch(self, key: Hashable) -> None:
        """Start the host-to-device copy of key (no-op when it is resident or offloading is off)."""
        if not self.offload or key in self._resident:
            return
        host = self._host[key]
        if self.cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):  # allocated on the side stream: freeing it unused stays ordered
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._ready[key] = ev
            self._resident[key] = dev
        else:
            self._resident[key] = host.clone()
        self.peak_resident = max(self.peak_resident, len(self._resident))

    def get(self, key: Hashable) -> Tensor:
        """The device tensor of key, waiting for its prefetch (started now when none was)."""
        if key not in self._resident:
            self.prefetch(key)
        ev = self._ready.pop(key, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self._resident[key].record_stream(torch.cuda.current_stream(self.device))
        return self._resident[key]

    def release(self, key: Hashable) -> None:
        """Drop the device copy of key (its host copy stays); no-op with offloading off."""
        if self.offload:
            self._resident.pop(key, None)
            self._ready.pop(key, None)

    def drop(self, key: Hashable) -> None:
        """Forget key entirely (device and host)."""
        self._resident.pop(key, None)
        self._ready.pop(key, None)
        self._host.pop(key, None)

    def synchronize(self) -> None:
        """Make the compute stream wait for every copy issued so far (before host buffers are reused)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def resident_count(self) -> int:
        return len(self._resident)
