"""Refuse, at initialize, a model whose ZeRO model states cannot fit the device even in the best case.

Without this a model too large for its configuration fails later with a CUDA out-of-memory error in the
middle of allocating partitions or of the first step, which names neither the model's size nor the
settings that would make it fit. The figures are lower bounds (model states only: no activations, buffers
or allocator slack), so a model refused here could never have trained; one that passes may still run out
of memory later, as in DeepSpeed.

Host memory is only warned about: a container's MemTotal can read far below what it may use (memory that
grows as it is touched), so a host figure is not a safe reason to refuse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from deepspeed_c.utils.logging import logger

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
          host_capacity: Optional[int]) -> None:
    """Raises ModelDoesNotFitError when `need.device` exceeds `device_capacity` (None: not checked); warns
    when the host figure exceeds `host_capacity`."""
    if device_capacity is not None and need.device > device_capacity:
        raise ModelDoesNotFitError(
            f"zero_optimization.stage={stage}: the model's {params / 1e9:.2f}B parameters need at least "
            f"{need.device / _GIB:.2f} GiB of device memory per rank for their model states alone (weights "
            f"{need.weights / _GIB:.2f}, gradients {need.gradients / _GIB:.2f}, optimizer states "
            f"{need.optimizer / _GIB:.2f} GiB; estimator lower bounds), but the device has "
            f"{device_capacity / _GIB:.2f} GiB. Offload them (zero_optimization.offload_optimizer.device / "
            f"offload_param.device: \"cpu\" or \"nvme\"), use a higher ZeRO stage, or more GPUs")
    if host_capacity is not None and need.host > host_capacity:
        logger.warning(f"zero_optimization offload: this node's ranks need at least {need.host / _GIB:.2f} GiB of "
                       f"host memory for the offloaded model states, and the host reports {host_capacity / _GIB:.2f} "
                       "GiB; the run may be killed for memory (offload to nvme instead)")


def device_capacity(device: torch.device) -> Optional[int]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None  # CPU ranks share the host: the host warning covers them
    return int(torch.cuda.get_device_properties(device).total_memory)


def host_capacity() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 (no reading: nothing to warn about)
        return None
