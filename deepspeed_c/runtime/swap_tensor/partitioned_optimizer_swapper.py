"""The optimizer state of a ZeRO optimizer in files (ZeRO-Infinity, `offload_optimizer.device: nvme`).

Each group's flat fp32 master partition and its optimizer moments (exp_avg, exp_avg_sq for Adam)
are cut into sub-groups of at most `sub_group_size` elements; every (group, sub-group, tensor) is
one file under `<nvme_path>/zero_stage_<s>/optimizer/rank<r>.<pid>.<n>/` (removed with the swapper). Between steps nothing of them is
in host memory: the master Parameters keep their identity (the optimizer's state is keyed by them)
but hold an empty tensor, and the moments in the optimizer's state are empty placeholders; only
the step counters stay. The step streams sub-groups through page-aligned slots
(pipelined_optimizer_swapper.NVMeOffload). `buffer_count` counts tensor buffers as DeepSpeed documents it ("at
least the number of states maintained per parameter by the optimizer", Adam's 4: parameter, gradient, momentum,
variance), so the same JSON pins the same host memory: a slot holds one sub-group's master and moments, and
buffer_count // (moments + 2) slots are made (at least one; two or more let the step read ahead).

Anything that needs the whole state at once (checkpoint save and load, masters re-cut from the
model, the model re-gathered from the masters) runs inside `resident()`: everything is read back
into ordinary tensors, and written out again and released when the outermost `resident()` exits.
So a checkpoint of an NVMe run is an ordinary checkpoint."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import torch

from deepspeed_c.runtime.swap_tensor.aio_config import AioConfig
from deepspeed_c.runtime.swap_tensor.utils import check_nvme_path, fresh_folder, new_handle

MASTER = "fp32"
ELEMENT_ALIGNMENT = 1024  # sub-group bounds on 4 KiB of fp32, so each file starts block-aligned in memory


def slots_for(buffer_count: int, n_moments: int) -> int:
    """Sub-group slots for DeepSpeed's `buffer_count` (tensor buffers; a sub-group's states are the parameter, its
    gradient and the optimizer's moments)."""
    return max(1, int(buffer_count) // (n_moments + 2))


def sub_group_bounds(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most sub_group_size elements (rounded to ELEMENT_ALIGNMENT) covering numel."""
    size = max(ELEMENT_ALIGNMENT, (int(sub_group_size) // ELEMENT_ALIGNMENT) * ELEMENT_ALIGNMENT)
    return [(lo, min(numel, lo + size)) for lo in range(0, numel, size)] or [(0, 0)]


def swap_bytes_needed(sizes: Sequence[int], master_dtype: torch.dtype, state_dtype: torch.dtype,
                      n_moments: int) -> int:
    m = torch.empty((), dtype=master_dtype).element_size()
    s = torch.empty((), dtype=state_dtype).element_size()
    return sum(n * (m + n_moments * s) for n in sizes)


class PartitionedOptimizerSwapper:
    """Files, slots and whole-state residency for one ZeRO optimizer's masters and moments."""

    def __init__(self, masters: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *, nvme_path: str,
                 stage: int, rank: int, aio: AioConfig, buffer_count: int, sub_group_size: int,
                 config_key: str = "zero_optimization.offload_optimizer.nvme_path") -> None:
        self.optimizer = optimizer
        self.masters = list(masters)
        self.moments: tuple[str, ...] = tuple(getattr(optimizer, "MOMENTS", ()))
        self.keys = (MASTER, *self.moments)
        self.sizes = [m.numel() for m in self.masters]
        self.master_dtypes = [m.dtype for m in self.masters]
        fp32_states = getattr(optimizer, "fp32_optimizer_states", True)
        self.state_dtypes = [torch.float32 if fp32_states else dt for dt in self.master_dtypes]
        need = sum(swap_bytes_needed([n], md, sd, len(self.moments))
                   for n, md, sd in zip(self.sizes, self.master_dtypes, self.state_dtypes))
        base = check_nvme_path(config_key, nvme_path, need)
        self.folder, self._finalizer = fresh_folder(
            os.path.join(base, f"zero_stage_{stage}", "optimizer", f"rank{rank}"), self)
        self.bounds = [sub_group_bounds(n, sub_group_size) for n in self.sizes]
        self.read_handle = new_handle(aio)
        self.write_handle = new_handle(aio)
        self.slot_count = slots_for(buffer_count, len(self.moments))
        largest = max(hi - lo for b in self.bounds for lo, hi in b)
        self.slot_bytes = largest * max(torch.empty((), dtype=dt).element_size()
                                        for dt in (*self.master_dtypes, *self.state_dtypes))
        example = torch.empty(0, dtype=torch.uint8)
        self.slots = [{k: self.read_handle.new_cpu_locked_tensor(self.slot_bytes, example) for k in self.keys}
                      for _ in range(self.slot_count)]
        self._depth = 0
        self._write_initial_state()

    # -- files ------------------------------------------------------------------------------------
    def path(self, g: int, s: int, key: str) -> str:
        return os.path.join(self.folder, f"g{g}_s{s}_{key}.tensor.swp")

    def dtype(self, g: int, key: str) -> torch.dtype:
        return self.master_dtypes[g] if key == MASTER else self.state_dtypes[g]

    def slot_views(self, slot: int, g: int, s: int) -> dict[str, torch.Tensor]:
        lo, hi = self.bounds[g][s]
        out = {}
        for key, raw in self.slots[slot].items():
            dt = self.dtype(g, key)
            out[key] = raw[:(hi - lo) * torch.empty((), dtype=dt).element_size()].view(dt)
        return out

    def read_async(self, slot: int, g: int, s: int) -> dict[str, torch.Tensor]:
        views = self.slot_views(slot, g, s)
        for key, t in views.items():
            self.read_handle.async_pread(t, self.path(g, s, key))
        return views

    def write_async(self, views: dict[str, torch.Tensor], g: int, s: int) -> None:
        for key, t in views.items():
            self.write_handle.async_pwrite(t, self.path(g, s, key))

    def group_state(self, g: int) -> dict[str, Any]:
        """Group g's optimizer state, its step counter as the C optimizers keep it (a float32 host scalar)."""
        state = self.optimizer.state[self.masters[g]]
        step = state.get("step", 0)
        if not torch.is_tensor(step) or step.dtype != torch.float32 or step.device.type != "cpu":
            # the C optimizers count steps in a float32 host scalar (a loaded checkpoint may hold an int)
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return state

    def _write_initial_state(self) -> None:
        """Masters as cut from the model, moments zero (or as the optimizer holds them); then released."""
        for g, master in enumerate(self.masters):
            state = self.group_state(g)
            for key in self.keys:
                whole = master.detach() if key == MASTER else state.get(key)
                for s, (lo, hi) in enumerate(self.bounds[g]):
                    if whole is not None and torch.is_tensor(whole) and whole.numel() == self.sizes[g]:
                        part = whole.reshape(-1)[lo:hi].to(self.dtype(g, key)).contiguous()
                    else:
                        part = self.slot_views(0, g, s)[key].zero_()
                    self.write_handle.sync_pwrite(part, self.path(g, s, key))
        self._release()

    def _release(self) -> None:
        """Every master and moment back to an empty placeholder (their bytes live in the files)."""
        with torch.no_grad():
            for g, master in enumerate(self.masters):
                master.data = torch.empty(0, dtype=self.master_dtypes[g])
                state = self.group_state(g)
                for key in self.moments:
                    state[key] = torch.empty(0, dtype=self.state_dtypes[g])

    # -- the whole state in memory, for checkpoints and re-cuts ---------------------------------------------
    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Inside: masters and moments are ordinary full tensors (read from the files); on the
        outermost exit they are written back (whatever the body left there) and released."""
        if self._depth == 0:
            try:
                self._swap_in_all()
            except BaseException:
                self._release()  # a failed read leaves nothing half in memory; the files are intact
                raise
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._swap_out_all()

    def _swap_in_all(self) -> None:
        with torch.no_grad():
            for g, master in enumerate(self.masters):
                whole = {k: torch.empty(self.sizes[g], dtype=self.dtype(g, k)) for k in self.keys}
                for s, (lo, hi) in enumerate(self.bounds[g]):
                    for key, t in whole.items():
                        self.read_handle.async_pread(t[lo:hi], self.path(g, s, key))
                self.read_handle.wait()
                master.data = whole[MASTER]
                state = self.group_state(g)
                for key in self.moments:
                    state[key] = whole[key]

    def _swap_out_all(self) -> None:
        for g, master in enumerate(self.masters):
            state = self.group_state(g)
            for key in self.keys:
                t = master.detach() if key == MASTER else state.get(key)
                if not torch.is_tensor(t) or t.numel() != self.sizes[g]:
                    raise RuntimeError(f"NVMe optimizer swapper: group {g}'s {key} has {getattr(t, 'numel', lambda: 0)()}"
                                       f" elements after a whole-state operation, expected {self.sizes[g]}")
                flat = t.detach().reshape(-1).to(device="cpu", dtype=self.dtype(g, key)).contiguous()
                for s, (lo, hi) in enumerate(self.bounds[g]):
                    self.write_handle.async_pwrite(flat[lo:hi], self.path(g, s, key))
            self.write_handle.wait()
        self._release()

    def close(self) -> None:
        """The swap files go (the engine is destroyed); the state is gone with them."""
        for h in (self.read_handle, self.write_handle):
            h.wait()
        self._finalizer()

    def slot_bytes_total(self) -> int:
        """Host bytes of the pipeline's slots: the optimizer state's resident bound."""
        return self.slot_count * len(self.keys) * self.slot_bytes
