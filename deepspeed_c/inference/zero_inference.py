"""ZeRO-Inference: `init_inference(model, zero={"stage": 3, "offload_param": {"device": "cpu" | "nvme", ...}})`.

The transformer layers' weights live off the accelerator -- in one page-locked host buffer per layer
("cpu"), or in one file per layer under offload_param.nvme_path ("nvme", read through the async I/O core
into page-locked staging buffers) -- and are streamed into one of two device buffers as the forward
reaches each layer: a forward pre-hook makes the layer's weights views of its device buffer (waiting for
its copy) and starts the copy of the next layer into the other buffer (on a side stream, after the layer
that last used that buffer finished), so reading layer i+1 overlaps computing layer i. After the last
layer the first is fetched again: the next decode step starts with it in place. Everything outside the
layers (embeddings, final norm, head) and the layers' 1-D parameters (biases, norm weights) stay on the
device. A model larger than the device's memory
generates on it: the device holds two layers and the rest.

The layers are the model's largest nn.ModuleList (by parameter count): HF decoders' `h` / `layers`,
encoders' `layer`, and the kernel-injected blocks alike."""
from __future__ import annotations

import os
import shutil
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn

from deepspeed_c.accelerator.host_memory import host_empty

_OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}


def parse(zero: dict) -> Optional[dict]:
    """The offload_param section to stream with, or None when `zero` asks for nothing."""
    if not zero:
        return None
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage != 3:  # repr: a string "3" must not read as the 3 it is refused for
        raise ValueError(f"init_inference: zero.stage={stage!r}: ZeRO-Inference streams the parameters of ZeRO stage "
                         "3 only (an int); use zero={'stage': 3, 'offload_param': {'device': 'cpu' | 'nvme'}} or "
                         "leave zero out")
    off = dict(zero.get("offload_param") or {})
    unknown = sorted(set(off) - _OFFLOAD_KEYS)
    if unknown:
        raise ValueError(f"init_inference: zero.offload_param has unknown key(s) {unknown} (expected some of "
                         f"{sorted(_OFFLOAD_KEYS)})")
    device = str(off.get("device", "none")).lower()
    if device not in ("cpu", "nvme"):
        raise ValueError(f"init_inference: zero.offload_param.device={device!r}: ZeRO-Inference on one accelerator "
                         "needs the weights offloaded to 'cpu' or 'nvme'")
    if device == "nvme" and not off.get("nvme_path"):
        raise ValueError("init_inference: zero.offload_param.device='nvme' needs zero.offload_param.nvme_path")
    other = sorted(set(zero) - {"stage", "offload_param"})
    if other:
        raise ValueError(f"init_inference: zero key(s) {other} are not used by ZeRO-Inference (stage, offload_param)")
    off["device"] = device
    return off


def _layers(model: nn.Module) -> nn.ModuleList:
    best, size = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                best, size = module, n
    if best is None:
        raise ValueError(f"init_inference: ZeRO-Inference found no list of layers in {type(model).__name__}")
    return best


class LayerStreamer:
    """Owns the off-device copies of the layers' weights and the two device buffers they stream through."""

    def __init__(self, model: nn.Module, offload: dict, device: torch.device) -> None:
        self.device = torch.device(device)
        self.layers = _layers(model)
        self.kind = offload["device"]
        self.cuda = self.device.type == "cuda"
        pin = bool(offload.get("pin_memory", True)) and self.cuda
        self.params: list[list[tuple[nn.Parameter, int, int]]] = []  # per layer: (param, offset, numel)
        dtypes = {p.dtype for p in self.layers.parameters() if p.dim() >= 2}
        if len(dtypes) != 1:
            raise ValueError(f"init_inference: ZeRO-Inference needs one dtype for the layers' weights, got {dtypes}")
        self.dtype = dtypes.pop()
        sizes = []
        for layer in self.layers:
            entries, off = [], 0
            for p in layer.parameters():
                if p.dim() < 2:  # biases and norm weights stay on the device: tiny, and a fused block hands its
                    continue     # last bias to the next block (fused_block: pending residual add)
                entries.append((p, off, p.numel()))
                p._dsc_zi_shape = tuple(p.shape)  # p.shape reads the placeholder between streams
                off += p.numel()
            self.params.append(entries)
            sizes.append(off)
        self.sizes = sizes
        biggest = max(sizes)
        self.host: list[Optional[Tensor]] = []
        self.files: list[str] = []
        self.aio = None
        if self.kind == "nvme":
            from deepspeed_c.ops.aio import aio_handle

            folder = os.path.join(offload["nvme_path"], f"zero_inference_{os.getpid()}_{id(self)}")
            os.makedirs(folder, exist_ok=True)
            self.aio = aio_handle(atomic_writes=False)
            weakref.finalize(self, shutil.rmtree, folder, True)  # the layer files go with the engine
            self.staging = [self._host_buffer(biggest, pin) for _ in range(2)]
        for i, layer in enumerate(self.layers):
            flat = self._host_buffer(sizes[i], pin and self.kind == "cpu")
            for p, off, n in self.params[i]:
                flat[off:off + n].copy_(p.data.reshape(-1))
            if self.kind == "nvme":
                path = os.path.join(folder, f"layer_{i:05d}.bin")
                self.aio.sync_pwrite(flat, path)
                self.files.append(path)
                self.host.append(None)
            else:
                self.host.append(flat)
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for i in range(len(self.layers)):  # a layer holds nothing until streamed in
            for p, _, _ in self.params[i]:
                p.data = self._empty
        self.buffers = [torch.empty(biggest, dtype=self.dtype, device=self.device) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: list[Optional[Any]] = [None, None]   # copy-done events per device buffer
        self.copied: list[Optional[Any]] = [None, None]  # nvme: staging buffer's device copy done
        self.freed: list[Optional[Any]] = [None, None]   # compute-done events per device buffer
        self.loaded: list[int] = [-1, -1]                # which layer each buffer holds (or is receiving)
        self.reading: Optional[tuple] = None             # nvme: (layer, staging slot) of the read in flight
        self.current: Optional[int] = None               # the buffer the running layer reads
        self._hooks = []
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(self._pre_hook(i)))
            self._hooks.append(layer.register_forward_hook(self._post_hook(i)))

    def _host_buffer(self, n: int, pin: bool) -> Tensor:
        return host_empty(n, self.dtype, pin)  # page-locked at exactly its size (a layer's weights, kept all run)

    # ---- moving one layer ----------------------------------------------------------------------------
    def _source(self, i: int, slot: int) -> Tensor:
        """Layer i's weights on the host (for nvme: read into staging buffer `slot`, waiting for the read)."""
        if self.kind == "cpu":
            return self.host[i]
        if self.reading != (i, slot):
            self._start_read(i, slot)
        self.aio.wait()
        self.reading = None
        return self.staging[slot][:self.sizes[i]]

    def _start_read(self, i: int, slot: int) -> None:
        if self.reading is not None:
            self.aio.wait()
        if self.copied[slot] is not None:  # the staging buffer's previous device copy must be done
            self.copied[slot].synchronize()
        self.aio.async_pread(self.staging[slot][:self.sizes[i]], self.files[i])
        self.reading = (i, slot)

    def _fetch(self, i: int, slot: int) -> None:
        """Start copying layer i into device buffer `slot` (after the layer that last used it finished)."""
        src = self._source(i, slot)
        dst = self.buffers[slot][:self.sizes[i]]
        if self.stream is None:
            dst.copy_(src)
        else:
            if self.freed[slot] is not None:
                self.stream.wait_event(self.freed[slot])
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                self.ready[slot] = torch.cuda.Event()
                self.ready[slot].record(self.stream)
            self.copied[slot] = self.ready[slot]
        self.loaded[slot] = i

    def _pre_hook(self, i: int):
        shapes = [p._dsc_zi_shape for p, _, _ in self.params[i]]

        def hook(module: nn.Module, args: Any) -> None:
            if i in self.loaded:
                slot = self.loaded.index(i)
            else:  # not prefetched (first call, or a forward that skipped layers): fetch it now
                slot = 0 if self.current is None else 1 - self.current
                self._fetch(i, slot)
            if self.stream is not None and self.ready[slot] is not None:
                torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            buf = self.buffers[slot]
            for (p, off, n), shape in zip(self.params[i], shapes):
                p.data = buf[off:off + n].view(shape)
            self.current = slot
            nxt, other = (i + 1) % len(self.layers), 1 - slot
            if nxt == i:
                return
            if self.kind == "nvme" and self.stream is not None:
                self._start_read(nxt, other)  # the file read overlaps this layer; its device copy starts next hook
                self.loaded[other] = -1
            else:
                self._fetch(nxt, other)
        return hook

    def _post_hook(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for p, _, _ in self.params[i]:
                p.data = self._empty
            if self.stream is not None:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self.freed[self.current] = ev
        return hook

    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host if h is not None)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        if self.kind == "nvme":
            for path in self.files:
                if os.path.exists(path):
                    os.remove(path)
