"""Refuse, at initialize, a model whose ZeRO model states cannot fit the device or the host even in the best case.

Without this a model too large for its configuration fails later with a CUDA out-of-memory error in the
middle of allocating partitions or of the first step, which names neither the model's size nor the
settings that would make it fit. The figures are lower bounds (model states only: no activations, buffers
or allocator slack), so a model refused here could never have trained; one that passes may still run out
of memory later, as in DeepSpeed.

The host figure (offloaded optimizer states and parameters of this node's ranks) is checked against RAM plus
swap, the most that can ever be resident; a container limit below that is not read (an OOM kill still names
itself). NVMe offload needs no host memory in this bound."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

_GIB = float(1 << 30)


class ModelDoesNotFitError(RuntimeError):
    """The model's ZeRO model states need more device memory per rank than the device has."""


@dataclass(frozen=True)
class StateBytes:
    """Lower bounds of one rank's model-state bytes on the device, and of one node's on the host."""
    weights: int
    gradients: int
    optimizer: int
    host: int

    @property
    def device(self) -> int:
        return self.weights + self.gradients + self.optimizer


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state per trainable parameter (fp32 moments): Adam/AdamW/LAMB keep two, others
    are counted as none (a lower bound)."""
    name = type(optimizer).__name__.lower()
    return 8 if ("adam" in name or "lamb" in name) else 0


def lower_bounds(stage: int, params: int, trainable: int, largest_layer: int, world: int, local_world: int,
                 param_bytes: int, state_bytes: int, offload_optimizer: Optional[str],
                 offload_param: Optional[str]) -> StateBytes:
    """Model-state bytes a rank cannot do without, as ZeRO `stage` lays them out over `world` ranks.
    `offload_*`: None, "cpu" or "nvme"."""
    master = 4 if param_bytes < 4 else 0  # fp32 masters beside 16-bit weights
    if stage >= 3:
        weights = (0 if offload_param else params * param_bytes // world) + largest_layer * param_bytes
    else:
        weights = params * param_bytes
    offloaded = offload_optimizer is not None
    grads = 0 if offloaded else (trainable * param_bytes // world if stage >= 2 else trainable * param_bytes)
    optim = 0 if offloaded else trainable * (master + state_bytes) // (world if stage >= 1 else 1)
    host = 0
    if offload_optimizer == "cpu":
        host += trainable * (4 + state_bytes) * local_world // world
    if offload_param == "cpu":
        host += params * param_bytes * local_world // world
    return StateBytes(weights, grads, optim, host)


def check(need: StateBytes, stage: int, params: int, device_capacity: Optional[int],
          host_capacity: Optional[int], offload_optimizer: Optional[str] = None,
          offload_param: Optional[str] = None) -> None:
    """Raises ModelDoesNotFitError when `need.device` exceeds `device_capacity` or `need.host` exceeds
    `host_capacity` (None: not checked), naming both figures against what is available and what to change
    given the offload already configured (`offload_*`: None, "cpu" or "nvme")."""
    device_short = device_capacity is not None and need.device > device_capacity
    host_short = host_capacity is not None and need.host > host_capacity
    if not (device_short or host_short):
        return
    device = (f"device: at least {_size(need.device)} per rank (weights {_size(need.weights)}, gradients "
              f"{_size(need.gradients)}, optimizer states {_size(need.optimizer)}) vs "
              + (f"{_size(device_capacity)} the device has" if device_capacity is not None
                 else "not checked (CPU ranks)"))
    host = (f"host: at least {_size(need.host)} for this node's ranks' offloaded model states "
            + (f"vs {_size(host_capacity)} of host memory (RAM + swap)" if host_capacity is not None
               else "(the host's memory was not read)"))
    raise ModelDoesNotFitError(
        f"zero_optimization.stage={stage}: the model's {params / 1e9:.2f}B parameters do not fit, even counting "
        f"their model states alone (estimator lower bounds; activations come on top): {device}"
        f"{f'; {host}' if need.host or host_short else ''}. "
        f"To fit: {'; '.join(_remedies(stage, device_short, host_short, offload_optimizer, offload_param))}")


def _size(n: int) -> str:
    """GiB, or MiB below a tenth of one (so a small figure does not read as 0.00)."""
    return f"{n / _GIB:.2f} GiB" if n >= _GIB / 10 else f"{n / (1 << 20):.2f} MiB"


def _remedies(stage: int, device_short: bool, host_short: bool, offload_optimizer: Optional[str],
              offload_param: Optional[str]) -> list[str]:
    """What would make the figures fit, given what is already offloaded."""
    out = []
    if device_short:
        if offload_optimizer is None:
            out.append('offload the optimizer states (zero_optimization.offload_optimizer.device: "cpu" or "nvme")')
        if stage < 3:
            out.append("use zero_optimization.stage 3 (parameters partitioned too)")
        elif offload_param is None:
            out.append('offload the parameters (zero_optimization.offload_param.device: "cpu" or "nvme")')
        if offload_optimizer is not None and (stage >= 3 and offload_param is not None):
            out.append("everything is offloaded already: the largest module's weights must fit the device at once "
                       "(split that module, or a device with more memory)")
        else:
            out.append("or more GPUs")
    if host_short:
        out.append('offload to "nvme" instead of "cpu" (offload_optimizer / offload_param .device, with nvme_path), '
                   "fewer ranks a node, or more nodes")
    return out


def device_capacity(device: torch.device) -> Optional[int]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None  # CPU ranks share the host: the host warning covers them
    return int(torch.cuda.get_device_properties(device).total_memory)


def host_capacity() -> Optional[int]:
    """RAM plus swap: offloaded model states beyond it can never be resident at once."""
    try:
        import psutil

        return int(psutil.virtual_memory().total) + int(psutil.swap_memory().total)
    except Exception:  # noqa: BLE001 (no reading: nothing to warn about)
        return None
