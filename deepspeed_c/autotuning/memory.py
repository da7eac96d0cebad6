"""The tuner's memory model: bytes a rank needs at one point of the space, from the probe's model
info (parameter count, activation bytes per sample), so that points that cannot fit are never
launched.

Model states per rank, with Adam-style optimizers (two fp32 states per parameter) over P
parameters and W data-parallel ranks (the ZeRO paper's accounting):

    fp32 training:  params 4P, grads 4P, optimizer 8P
    fp16/bf16:      params 2P, grads 2P, optimizer 12P (fp32 master + two states)
    stage 0 keeps all, 1 partitions the optimizer, 2 also the grads, 3 also the params;
    offload_optimizer to cpu moves the optimizer part off the device.

over the data-parallel ranks W = world / mp_size (the probe counts the parameters a rank holds, so
model parallelism is already in P), plus micro-batch x activation bytes per sample, measured by the
probe without activation checkpointing (`activation_mem_per_sample`) and, when the checkpointing axis
is tuned, by a second probe with it (`activation_mem_per_sample_ckpt`). The budget is DSC_AUTOTUNING_MEMORY_BUDGET_BYTES
(bytes per rank) when set, else the accelerator's memory per device on a GPU machine, else none
(nothing pruned)."""
from __future__ import annotations

import os
from typing import Any, Optional

BUDGET_ENV = "DSC_AUTOTUNING_MEMORY_BUDGET_BYTES"


def budget_bytes() -> Optional[int]:
    raw = os.environ.get(BUDGET_ENV)
    if raw:
        try:
            return int(float(raw))
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={raw!r}: expected a number of bytes") from None
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # no usable accelerator: no budget
        pass
    return None


def _half(ds: dict[str, Any]) -> bool:
    return any(isinstance(ds.get(k), dict) and ds[k].get("enabled", False) for k in ("fp16", "bf16"))


def model_state_bytes(num_params: int, stage: int, world: int, half: bool, offload: bool = False) -> float:
    p = float(num_params)
    params, grads, optim = (2 * p, 2 * p, 12 * p) if half else (4 * p, 4 * p, 8 * p)
    if offload:
        optim = 0.0
    if stage >= 1:
        optim /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        params /= world
    return params + grads + optim


def _offloaded(ds: dict[str, Any]) -> bool:
    off = ds["zero_optimization"].get("offload_optimizer")
    return isinstance(off, dict) and off.get("device") in ("cpu", "nvme")


def activation_bytes_per_sample(model_info: dict[str, Any], ckpt: Optional[bool]) -> float:
    key = "activation_mem_per_sample_ckpt" if ckpt else "activation_mem_per_sample"
    if key not in model_info:
        raise ValueError(f"autotuning: the model-info probe did not measure {key!r}")
    return float(model_info[key])


def states_bytes(ds: dict[str, Any], model_info: dict[str, Any], world: int, mp_size: int = 1) -> float:
    dp = max(world // max(mp_size, 1), 1)
    return model_state_bytes(int(model_info["num_params"]), int(ds["zero_optimization"]["stage"]), dp, _half(ds),
                             _offloaded(ds))


def estimate_bytes(ds: dict[str, Any], model_info: dict[str, Any], world: int, mp_size: int = 1,
                   ckpt: Optional[bool] = None) -> float:
    """Per-rank bytes of one experiment config (micro-batch from the config)."""
    mbs = int(ds["train_micro_batch_size_per_gpu"])
    return states_bytes(ds, model_info, world, mp_size) + mbs * activation_bytes_per_sample(model_info, ckpt)


def largest_micro_batch(ds: dict[str, Any], model_info: dict[str, Any], world: int, budget: float, mp_size: int = 1,
                        ckpt: Optional[bool] = None, ceiling: int = 1 << 30) -> int:
    """The largest micro-batch whose estimate stays within the budget (0: not even one sample;
    `ceiling` when activations measured nothing)."""
    free = budget - states_bytes(ds, model_info, world, mp_size)
    act = activation_bytes_per_sample(model_info, ckpt)
    if free < 0:
        return 0
    return ceiling if act <= 0 else min(int(free // act), ceiling)
