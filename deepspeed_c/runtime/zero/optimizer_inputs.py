"""What the ZeRO optimizers need from the config, as plain values: the supported-optimizer check, the
host optimizer's threads, the master dtype, the NVMe swap arguments and the ZeRO-3 store arguments.
Every function takes config sections and values, never the engine; the engine builds its ZeRO
optimizer from them in deepspeed_c/runtime/engine/zero_setup.py."""
from __future__ import annotations

from typing import Any, Optional

import torch

# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS, by class name (ours mirror DeepSpeed's)
ZERO_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "Adagrad", "DeepSpeedCPUAdagrad",
                             "DeepSpeedCPULion", "FusedLion", "MuonWithAuxAdam")


def is_zero_supported_optimizer(optimizer: Any) -> bool:
    return type(optimizer).__name__ in ZERO_SUPPORTED_OPTIMIZERS


def check_optimizer(basic: torch.optim.Optimizer, *, allow_untested: bool, require_cpu_optimizer: bool) -> None:
    """allow_untested: zero_allow_untested_optimizer; require_cpu_optimizer: ZeRO-Offload with a client
    optimizer and zero_force_ds_cpu_optimizer (the client's optimizer must then be a host optimizer)."""
    if not is_zero_supported_optimizer(basic) and not allow_untested:
        raise AssertionError('You are using an untested ZeRO Optimizer. Please add <"zero_allow_untested_optimizer": '
                             'true> in the configuration file to use it.')
    if require_cpu_optimizer:
        from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase

        if not isinstance(basic, CPUOptimizerBase):
            from deepspeed_c.runtime.zero.utils import ZeRORuntimeException  # utils imports this module

            raise ZeRORuntimeException(f"You are using ZeRO-Offload with a client provided optimizer "
                                       f"({type(basic).__name__}) which in most cases will yield poor performance. "
                                       f"Please either use deepspeed_c.ops.adam.DeepSpeedCPUAdam or set an optimizer "
                                       f"in your ds-config. If you really want to use a custom optimizer with "
                                       f'ZeRO-Offload, set <"zero_force_ds_cpu_optimizer": false> in your '
                                       f'configuration file.')


def offload_threads(zero_cfg: Any) -> Optional[int]:
    """OpenMP threads of the host optimizer when offload_optimizer.cpuadam_cores_perc is set: that share
    of the cores this rank may run on (its affinity set, split among the node's ranks unless the
    launcher bound cores per rank)."""
    offload = zero_cfg.offload_optimizer
    if offload is None or "cpuadam_cores_perc" not in offload.model_fields_set:
        return None
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")) or 1)
    if cores >= (os.cpu_count() or cores) and local > 1:
        cores //= local  # not bound per rank: the node's ranks share the cores
    return max(1, int(cores * float(offload.cpuadam_cores_perc)))


def master_dtype(cfg: Any) -> torch.dtype:
    """fp32 masters, or the model dtype under fp16/bf16 `*_master_weights_and_grads` (DeepSpeed: master
    weights and gradients of the partition kept in 16 bits; optimizer states follow the optimizer: torch
    optimizers keep them in the parameter dtype, DeepSpeedCPUAdam in fp32 unless told otherwise)."""
    if cfg.float16_config.enabled and cfg.float16_config.fp16_master_weights_and_grads:
        return torch.float16
    if cfg.bfloat16_config.enabled and cfg.bfloat16_config.bf16_master_weights_and_grads:
        return torch.bfloat16
    return torch.float32


def nvme_offload_args(zero_cfg: Any, aio_cfg: Any, stage: int, rank: int) -> Optional[dict]:
    """offload_optimizer.device 'nvme': where and how the optimizer state is swapped (None otherwise)."""
    offload = zero_cfg.offload_optimizer
    if offload is None or offload.device != "nvme":
        return None
    return dict(nvme_path=offload.nvme_path, stage=stage, rank=rank, aio=aio_cfg, buffer_count=offload.buffer_count,
                sub_group_size=zero_cfg.sub_group_size)


def zero3_store_args(zero_cfg: Any, dtype: torch.dtype, compute_device: torch.device) -> dict:
    """How the ZeRO-3 parameter store keeps its shards (dtype: the model's, compute_device: the rank's)."""
    offload = zero_cfg.offload_param
    on_host = offload is not None and offload.device == "cpu"
    on_nvme = offload is not None and offload.device == "nvme"
    return dict(dtype=dtype, compute_device=compute_device,
                home_device=torch.device("cpu") if on_host else None,
                pin_memory=bool(on_host and offload.pin_memory),
                persistence_threshold=zero_cfg.param_persistence_threshold,
                model_persistence_threshold=zero_cfg.model_persistence_threshold,
                param_swap=dict(nvme_path=offload.nvme_path, buffer_count=offload.buffer_count,
                                buffer_size=offload.buffer_size, max_in_cpu=offload.max_in_cpu,
                                pin_buffers=offload.pin_memory) if on_nvme else None)
