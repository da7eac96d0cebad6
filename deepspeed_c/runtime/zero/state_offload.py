"""`engine.offload_states()` / `engine.reload_states()` for ZeRO 1/2: DeepSpeed 0.19.8's API for
freeing device memory between phases (e.g. generation in RLHF), moving the optimizer's states to
host memory and back.

State types (DeepSpeed's OffloadStateTypeEnum): `hp_params` (this rank's fp32 master partitions),
`optim_states` (the optimizer's tensors for them: Adam moments), `lp_params` (the model's 16-bit
parameters), `lp_grads` (the reduced gradient partitions held between micro-steps) and
`contiguous_grad_buffer` (DeepSpeed's flat gradient buffer; here the bucket buffers are transient,
so nothing is held to move). Tensors keep their identity: their `.data` moves, so the optimizer,
its state dict and user references stay valid; the fused step's device scratch is dropped and
rebuilt on the next step. With CPU optimizer offload the masters and optimizer state already live
in host memory and are left out, as DeepSpeed does."""
from __future__ import annotations

from enum import Enum
from typing import Any, Container, Optional

import torch


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def _move(t: torch.Tensor, device: torch.device, pin: bool, non_blocking: bool) -> None:
    if t.device == device:
        return
    if device.type == "cpu" and pin and torch.cuda.is_available():
        dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        dst.copy_(t, non_blocking=non_blocking)
        t.data = dst
    else:
        t.data = t.data.to(device, non_blocking=non_blocking)


class ZeroStateOffload:
    """Remembers what was moved where, so reload_states puts each tensor back."""

    def __init__(self, optimizer: Any) -> None:
        self.opt = optimizer
        self.offloaded: dict[OffloadStateTypeEnum, list[tuple[torch.Tensor, torch.device]]] = {}

    def _tensors(self, kind: OffloadStateTypeEnum) -> list[torch.Tensor]:
        opt = self.opt
        if kind == OffloadStateTypeEnum.hp_params:
            return list(opt.fp32_partitions)
        if kind == OffloadStateTypeEnum.optim_states:
            return [v for m in opt.fp32_partitions for v in opt.optimizer.state.get(m, {}).values()
                    if torch.is_tensor(v) and v.device.type != "cpu"]
        if kind == OffloadStateTypeEnum.lp_params:
            return opt.lp_storage()
        if kind == OffloadStateTypeEnum.lp_grads:
            return [t for t in opt.reducer.grad_partitions if t is not None]
        return []  # contiguous_grad_buffer: the bucket buffers only live inside a backward

    def offload(self, include: Optional[Container[Any]], device: Any, pin_memory: bool, non_blocking: bool) -> None:
        target = torch.device(getattr(device, "value", device))
        kinds = [OffloadStateTypeEnum(k) for k in (include if include is not None else list(OffloadStateTypeEnum))]
        if self.opt.offload is not None:  # masters and optimizer state are in host memory already
            kinds = [k for k in kinds if k not in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)]
        for kind in kinds:
            if kind in self.offloaded:
                continue
            moved = []
            for t in self._tensors(kind):
                moved.append((t, t.device))
                _move(t, target, pin_memory, non_blocking)
            self.offloaded[kind] = moved
        self.opt.drop_device_scratch()

    def reload(self, non_blocking: bool) -> None:
        for moved in self.offloaded.values():
            for t, device in moved:
                _move(t, device, False, non_blocking)
        self.offloaded = {}
        self.opt.drop_device_scratch()
