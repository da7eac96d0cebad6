"""ZeRO-3 parameters on NVMe (`offload_param: {device: nvme, nvme_path}`).

Each parameter group's shard (this rank's model-dtype partition, runtime/zero/param_store.py) is a
shared memory mapping of one swap file under `<nvme_path>/zero_stage_3/<dtype>params/rank<r>.<pid>.<n>/`:
the bytes live in the file; host memory holds only the pages in use, which the kernel reads on
demand, writes back when they change and evicts under memory pressure. Everything the store does
with its shards (gather chunks, write-backs after a step, checkpoints, ds_tensor views) works on
the mapping unchanged. When the fetch plan starts gathering a unit ahead of its use (prefetch), the
unit's byte range is handed to the kernel's read-ahead (POSIX_FADV_WILLNEED), so the read from the
device overlaps the modules running before it.

Not used from DeepSpeed's section: buffer_count, buffer_size and max_in_cpu (DeepSpeed's
swap-in buffers; here the page cache plays their part)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from deepspeed_c.runtime.swap_tensor.utils import check_nvme_path, fresh_folder
from deepspeed_c.runtime.zero.param_store import ParamStore

CONFIG_KEY = "zero_optimization.offload_param.nvme_path"


class NVMeParamStore(ParamStore):
    """A ParamStore whose shards are file-backed (one swap file per group)."""

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], owner: dict[int, int], *, nvme_path: str,
                 **kwargs: Any) -> None:
        kwargs.update(home_device=torch.device("cpu"), pin_memory=False)
        super().__init__(groups, owner, **kwargs)
        need = sum(s.numel() * s.element_size() for s in self.shards)
        base = check_nvme_path(CONFIG_KEY, nvme_path, need)
        kind = str(self.dtype).replace("torch.", "")
        self.folder, self._finalizer = fresh_folder(
            os.path.join(base, "zero_stage_3", f"{kind}params", f"rank{self.rank}"), self)
        self._fds: list[int] = []
        for g, shard in enumerate(self.shards):
            path = os.path.join(self.folder, f"g{g}.tensor.swp")
            if shard.numel() > 0:
                mapped = torch.from_file(path, shared=True, size=shard.numel(), dtype=self.dtype)
                mapped.copy_(shard)
                self.shards[g] = mapped
            else:
                open(path, "wb").close()
            self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        self.readahead_bytes = 0

    def swap_path(self, g: int) -> str:
        return os.path.join(self.folder, f"g{g}.tensor.swp")

    def fetch(self, units: Sequence[int], private: bool = False, lossy: bool = False) -> None:
        """Read-ahead of the units about to be gathered, then the store's gather."""
        es = torch.empty((), dtype=self.dtype).element_size()
        for u in units:
            if self.full[u] is None:
                start, end = self.chunk_range(u)
                if end > start:
                    os.posix_fadvise(self._fds[self.unit_of[u][0]], start * es, (end - start) * es,
                                     os.POSIX_FADV_WILLNEED)
                    self.readahead_bytes += (end - start) * es
        super().fetch(units, private, lossy)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", []):
            try:
                os.close(fd)
            except OSError:
                pass
