"""ZeRO-3 parameters on NVMe (`offload_param: {device: nvme, nvme_path, buffer_count, buffer_size,
max_in_cpu, pin_memory}`).

Where each group's shard (this rank's model-dtype partition, runtime/zero/param_store.py) lives:
- `max_in_cpu` (DeepSpeed's meaning): the optimizer's groups, in order, stay whole in host memory while
  their running total of this rank's elements fits in max_in_cpu; the groups after that, and the
  parameters no optimizer steps, go to NVMe. DeepSpeed decides per sub-group, here per param group
  (its default of 1e9 therefore keeps any model under 1e9 elements per rank in host memory, as there).
- A group on NVMe is one swap file under `<nvme_path>/zero_stage_3/<dtype>params/rank<r>.<pid>.<n>/`.
  Gathers read it through the swap-in buffers (param_swap_buffers.py): `buffer_count` buffers of at most
  `buffer_size` elements; a unit (one module's parameters, this rank's chunk) is read into a free
  buffer when the fetch plan starts its gather and gives the buffer back once the gather has consumed
  it, waiting for the oldest gather when every buffer is taken. A unit larger than buffer_size raises
  at construction naming the key and the size needed (DeepSpeed asserts the same per parameter).
- The colder paths (the step's write of the updated shard, masters cut at initialize, checkpoints,
  ds_tensor views, GatheredParameters write-backs) use a shared memory mapping of the same file; the
  pages they touch are dropped from the process right after each write and after each step, so the
  mapping holds no host memory between uses (the kernel writes the dirty pages to the file).
When the fetch plan starts gathering units ahead of use, their byte ranges go to the kernel's
read-ahead (POSIX_FADV_WILLNEED) before the reads."""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, Optional, Sequence

import torch

from deepspeed_c.runtime.swap_tensor.param_swap_buffers import SwapInBuffers, read_into
from deepspeed_c.runtime.swap_tensor.utils import check_nvme_path, fresh_folder
from deepspeed_c.runtime.zero.param_store import ParamStore

CONFIG_KEY = "zero_optimization.offload_param.nvme_path"
SECTION = "zero_optimization.offload_param"
_MADV_DONTNEED = 4
_libc: Optional[Any] = None


def _drop_pages(t: torch.Tensor, start: int = 0, end: Optional[int] = None) -> None:
    """Elements [start, end) of mapped tensor t leave the process's memory (a shared file mapping keeps
    its data: dirty pages stay in the page cache for writeback; the next touch faults them back)."""
    global _libc
    end = t.numel() if end is None else end
    if end <= start:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    es, page = t.element_size(), mmap.PAGESIZE
    base = t.data_ptr()
    lo = base + start * es
    lo -= lo % page
    lo = max(lo, base - base % page)
    hi = base + end * es
    _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


class NVMeParamStore(ParamStore):
    """A ParamStore whose shards (past max_in_cpu) are swap files, read through swap-in buffers."""

    file_backed = True

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], owner: dict[int, int], *, nvme_path: str,
                 buffer_count: int = 5, buffer_size: int = int(1e8), max_in_cpu: int = int(1e9),
                 pin_buffers: bool = False, trainable_groups: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.update(home_device=torch.device("cpu"), pin_memory=False)
        super().__init__(groups, owner, **kwargs)
        trainable = len(self.shards) - 1 if trainable_groups is None else trainable_groups
        self.on_nvme = self._place(int(max_in_cpu), trainable)
        self.in_cpu_numel = sum(s.numel() for g, s in enumerate(self.shards) if not self.on_nvme[g])
        self._nvme_units = [u for u, (g, _) in enumerate(self.unit_of) if self.on_nvme[g]]
        largest = max((e - s for s, e in map(self.chunk_range, self._nvme_units)), default=0)
        if largest > 0 and buffer_size < largest:
            raise ValueError(f"config key '{SECTION}.buffer_size' = {buffer_size} elements is smaller than a "
                             f"partition to swap in: {largest} elements (this rank's share of one module's "
                             f"parameters); set buffer_size to at least {largest}")
        if largest > 0 and buffer_count < 1:
            raise ValueError(f"config key '{SECTION}.buffer_count' = {buffer_count}: parameters on NVMe need at least "
                             f"one swap-in buffer of up to buffer_size elements")
        need = sum(s.numel() * s.element_size() for g, s in enumerate(self.shards) if self.on_nvme[g])
        base = check_nvme_path(CONFIG_KEY, nvme_path, need)
        kind = str(self.dtype).replace("torch.", "")
        self.folder, self._finalizer = fresh_folder(
            os.path.join(base, "zero_stage_3", f"{kind}params", f"rank{self.rank}"), self)
        self._fds: list[int] = []
        self._maps: list[Optional[torch.Tensor]] = []
        for g, shard in enumerate(self.shards):
            mapped: Optional[torch.Tensor] = None
            if self.on_nvme[g] and shard.numel() > 0:
                mapped = torch.from_file(self.swap_path(g), shared=True, size=shard.numel(), dtype=self.dtype)
                mapped.copy_(shard)
                self.shards[g] = mapped
                _drop_pages(mapped)
                self._fds.append(os.open(self.swap_path(g), os.O_RDONLY | os.O_CLOEXEC))
            elif not self.on_nvme[g] and pin_buffers and torch.cuda.is_available() and shard.numel() > 0:
                self.shards[g] = shard.pin_memory()  # max_in_cpu: kept on the host, pinned as DeepSpeed does
                self._fds.append(-1)
            else:
                self._fds.append(-1)
            self._maps.append(mapped)
        self.buffers = SwapInBuffers(min(buffer_count, len(self._nvme_units)), largest, self.dtype, pin_buffers)
        self._held: dict[int, int] = {}  # unit -> swap-in buffer its gather reads (insertion order: oldest first)
        self.readahead_bytes = 0
        self.bytes_read = 0
        self._sweep = True  # colder paths may have paged the mappings in since: drop them at the next fetch

    def _place(self, max_in_cpu: int, trainable: int) -> list[bool]:
        """Per group: on NVMe? The optimizer's groups stay on the host in order while they fit max_in_cpu."""
        on_nvme, kept = [], 0
        for g, shard in enumerate(self.shards):
            n = shard.numel()
            fits = g < trainable and kept + n <= max_in_cpu
            kept += n if fits else 0
            on_nvme.append(not fits)
        return on_nvme

    def swap_path(self, g: int) -> str:
        return os.path.join(self.folder, f"g{g}.tensor.swp")

    # -- reads: gathers take their chunks through the swap-in buffers ---------------------------------
    def fetch(self, units: Sequence[int], private: bool = False, lossy: bool = False) -> None:
        """Read-ahead of the units about to be gathered, then the store's gather (reading each chunk)."""
        if self._sweep:  # e.g. the masters cut from the shards at initialize, a checkpoint saved since
            self.drop_mapped_pages()
        es = torch.empty((), dtype=self.dtype).element_size()
        for u in units:
            g = self.unit_of[u][0]
            if self.full[u] is None and self.on_nvme[g]:
                start, end = self.chunk_range(u)
                if end > start:
                    os.posix_fadvise(self._fds[g], start * es, (end - start) * es, os.POSIX_FADV_WILLNEED)
                    self.readahead_bytes += (end - start) * es
        super().fetch(units, private, lossy)

    def source_chunk(self, u: int, start: int, end: int) -> torch.Tensor:
        g = self.unit_of[u][0]
        if not self.on_nvme[g] or end == start:
            return super().source_chunk(u, start, end)
        b = self._acquire()
        chunk = self.buffers.view(b, end - start)
        es = chunk.element_size()
        read_into(self._fds[g], chunk, start * es, self.swap_path(g))
        self.bytes_read += (end - start) * es
        if self.world_size > 1 and self.compute_device.type == "cpu":
            self._held[u] = b  # the gather reads the buffer: it is given back once that gather is done
            return chunk
        out = chunk.to(self.compute_device, copy=True)  # one rank, or a device: the unit owns its copy
        self.buffers.release(b)
        return out

    def _acquire(self) -> int:
        while True:
            b = self.buffers.acquire()
            if b is not None:
                return b
            oldest = next(iter(self._held))  # every buffer is held: finish the oldest gather, take its buffer
            work = self.works[oldest]
            if work is not None:
                work.wait()
                self.works[oldest] = None
            self.buffers.release(self._held.pop(oldest))

    def _give_back(self, units: Sequence[int]) -> None:
        for u in units:
            if u in self._held and self.works[u] is None:
                self.buffers.release(self._held.pop(u))

    def wait(self, units: Sequence[int], private: bool = False, lossy: bool = False) -> None:
        super().wait(units, private, lossy)
        self._give_back(units)

    def release(self, units: Sequence[int], keep_secondary: bool = True) -> None:
        super().release(units, keep_secondary)
        self._give_back(units)

    # -- writes: through the mapping, whose pages are dropped at once ---------------------------------
    def wrote(self, g: int, start: int, end: int) -> None:
        mapped = self._maps[g]
        if mapped is not None and self.shards[g] is mapped:
            _drop_pages(mapped, start, end)
            self._sweep = True  # a write-back's reader (the masters follow) may page the range in again

    def release_all(self, keep_persistent: bool = True) -> None:
        super().release_all(keep_persistent)
        self.drop_mapped_pages()
        self._sweep = True  # a checkpoint save reads the shards right after this

    def drop_mapped_pages(self) -> None:
        """Whatever the colder paths (masters, checkpoints, ds_tensor reads) paged in leaves the process."""
        self._sweep = False
        for g, mapped in enumerate(self._maps):
            if mapped is not None and self.shards[g] is mapped:
                _drop_pages(mapped)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", []):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
