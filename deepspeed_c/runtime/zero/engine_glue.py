"""Builds the ZeRO stage 1/2/3 optimizer for an engine from its config (called by
DeepSpeedEngine._configure_zero). Takes the engine as an argument; never imports it."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.runtime.config.utils import parse_dtype

from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS, by class name (ours mirror DeepSpeed's)
ZERO_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "Adagrad", "DeepSpeedCPUAdagrad",
                             "DeepSpeedCPULion", "FusedLion")


def is_zero_supported_optimizer(optimizer: Any) -> bool:
    return type(optimizer).__name__ in ZERO_SUPPORTED_OPTIMIZERS


def _check_optimizer(engine: Any, basic: torch.optim.Optimizer) -> None:
    if not is_zero_supported_optimizer(basic) and not engine.zero_allow_untested_optimizer():
        raise AssertionError('You are using an untested ZeRO Optimizer. Please add <"zero_allow_untested_optimizer": '
                             'true> in the configuration file to use it.')
    if engine.zero_use_cpu_optimizer() and engine.client_optimizer is not None and engine.zero_force_ds_cpu_optimizer():
        from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase

        if not isinstance(basic, CPUOptimizerBase):
            raise RuntimeError(f"You are using ZeRO-Offload with a client provided optimizer ({type(basic).__name__}) "
                               f"which in most cases will yield poor performance. Please either use "
                               f"deepspeed_c.ops.adam.DeepSpeedCPUAdam or set an optimizer in your ds-config. If you "
                               f"really want to use a custom optimizer with ZeRO-Offload, set "
                               f'<"zero_force_ds_cpu_optimizer": false> in your configuration file.')


def _offload_threads(zero_cfg: Any) -> Optional[int]:
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


def _master_dtype(cfg: Any) -> torch.dtype:
    """fp32 masters, or the model dtype under fp16/bf16 `*_master_weights_and_grads` (DeepSpeed: master
    weights and gradients of the partition kept in 16 bits; optimizer states follow the optimizer: torch
    optimizers keep them in the parameter dtype, DeepSpeedCPUAdam in fp32 unless told otherwise)."""
    if cfg.float16_config.enabled and cfg.float16_config.fp16_master_weights_and_grads:
        return torch.float16
    if cfg.bfloat16_config.enabled and cfg.bfloat16_config.bf16_master_weights_and_grads:
        return torch.bfloat16
    return torch.float32


def _nvme_offload_args(engine: Any, stage: int) -> Optional[dict]:
    """offload_optimizer.device 'nvme': where and how the optimizer state is swapped (None otherwise)."""
    zero_cfg = engine._config.zero_config
    offload = zero_cfg.offload_optimizer
    if offload is None or offload.device != "nvme":
        return None
    return dict(nvme_path=offload.nvme_path, stage=stage,
                rank=engine.get_data_parallel_rank() if engine.dp_world_size > 1 else 0,
                aio=engine._config.aio_config, buffer_count=offload.buffer_count,
                sub_group_size=zero_cfg.sub_group_size)


def configure_zero_optimizer(engine: Any) -> DeepSpeedZeroOptimizer:
    """Replaces the engine's (possibly mixed-precision wrapped) optimizer by the ZeRO optimizer."""
    stage = engine.zero_optimization_stage()
    basic = engine.basic_optimizer
    if engine.precision.grad_scaler is not None:
        raise NotImplementedError("deepspeed_c: torch_autocast with fp16 is not supported together with "
                                  f"zero_optimization.stage={stage}; use the fp16 section instead")
    _check_optimizer(engine, basic)
    # DeepSpeed's stage 1/2 optimizer starts each all-gather on a 4-byte boundary of 16-bit elements
    nccl_start_alignment_factor = 2
    if engine._config.zero_config.allgather_bucket_size % nccl_start_alignment_factor != 0:
        raise AssertionError(f"allgather_bucket_size must be a multiple of nccl_start_alignment_factor, "
                             f"{nccl_start_alignment_factor} (zero_optimization.allgather_bucket_size="
                             f"{engine._config.zero_config.allgather_bucket_size})")
    # the precision collaborator left the optimizer unwrapped (ZeRO owns the masters): only its scaling
    loss_scaler, check_overflow = engine.precision.zero_loss_scaling()
    zero_cfg = engine._config.zero_config
    offload = zero_cfg.offload_optimizer
    offload_device = "cpu" if engine.zero_use_cpu_optimizer() else None  # nvme: the host steps, files hold state
    cfg = engine._config
    if stage >= 2:
        # gradient partitioning: every micro-step's gradients are reduced into the partition (no_sync is
        # refused at stage 2, as in DeepSpeed)
        def should_reduce() -> bool:
            return bool(engine.enable_backward_allreduce)
    else:
        should_reduce = engine._should_reduce
    common = dict(
        rank=engine.get_data_parallel_rank() if engine.dp_world_size > 1 else 0,
        world_size=engine.dp_world_size, should_reduce=should_reduce,
        is_boundary=engine.is_gradient_accumulation_boundary, reduce_scatter=bool(zero_cfg.reduce_scatter),
        dp_process_group=engine.data_parallel_group, reduce_bucket_size=zero_cfg.reduce_bucket_size,
        allgather_bucket_size=zero_cfg.allgather_bucket_size, clip_grad=engine.gradient_clipping(),
        loss_scaler=loss_scaler, check_overflow=check_overflow,
        communication_dtype=engine.communication_data_type, offload_device=offload_device,
        pin_memory=bool(offload is not None and offload.pin_memory),
        overlap_comm=zero_cfg.overlap_comm if "overlap_comm" in zero_cfg.model_fields_set else None,
        ignore_unused_parameters=bool(zero_cfg.ignore_unused_parameters), offload_threads=_offload_threads(zero_cfg),
        prescale_gradients=cfg.prescale_gradients, gradient_predivide_factor=cfg.gradient_predivide_factor,
        gradient_average=engine.gradient_average, master_dtype=_master_dtype(cfg),
        # DeepSpeed's BF16_Optimizer case: stage 1, bf16 model, fp32 accumulation, no offload
        accumulate_fp32=(stage == 1 and engine.precision.model_dtype == torch.bfloat16 and offload_device is None
                         and parse_dtype(cfg.grad_accum_dtype, "data_types.grad_accum_dtype") == torch.float32),
        nvme_offload=_nvme_offload_args(engine, stage))
    sp = engine.parallel_dims.sequence  # Ulysses: gradients summed over the sequence ranks
    if engine.has_moe_layers:
        if stage == 3:
            raise NotImplementedError("zero_optimization.stage 3 with MoE layers is not built (DeepSpeed 0.19.8 refuses "
                                      "its native MoE layers at stage 3 too); use stage 0, 1 or 2")
        from deepspeed_c.runtime.zero.moe_zero import configure_moe_zero_optimizer

        optimizer = configure_moe_zero_optimizer(engine, basic, stage, common)
        engine.precision.set_scaling_owner(optimizer)
        return optimizer
    if stage == 3:
        from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        optimizer = DeepSpeedZeroOptimizer_Stage3(engine.module, basic, store_args=zero3_store_args(engine),
                                                  zero_cfg=zero_cfg, sequence_parallel_size=sp, **common)
    else:
        optimizer = DeepSpeedZeroOptimizer(basic, stage=stage, sequence_parallel_size=sp, **common)
        if zero_cfg.contiguous_gradients:  # Linear weight gradients computed straight into their bucket slots
            optimizer.reducer.install_direct_linears(engine.module)
    if engine.parallel_dims.tensor_parallel:
        # the norm of the unsharded model: shards summed over TP, replicas once (every rank: data x tensor)
        optimizer.set_tensor_parallel_norm(engine.parallel_dims.tensor, group=None)
    engine.precision.set_scaling_owner(optimizer)  # loss scaling reads cur_scale / note_backward_scale here
    return optimizer


def zero3_store_args(engine: Any) -> dict:
    """How the engine's ZeRO-3 parameter store keeps its shards."""
    zero_cfg = engine._config.zero_config
    offload = zero_cfg.offload_param
    on_host = offload is not None and offload.device == "cpu"
    on_nvme = offload is not None and offload.device == "nvme"
    return dict(dtype=engine.precision.model_dtype, compute_device=engine.device,
                home_device=torch.device("cpu") if on_host else None,
                pin_memory=bool(on_host and offload.pin_memory),
                persistence_threshold=zero_cfg.param_persistence_threshold,
                model_persistence_threshold=zero_cfg.model_persistence_threshold,
                param_swap=dict(nvme_path=offload.nvme_path, buffer_count=offload.buffer_count,
                                buffer_size=offload.buffer_size, max_in_cpu=offload.max_in_cpu,
                                pin_buffers=offload.pin_memory) if on_nvme else None)


def configure_zero3_params(engine: Any) -> Any:
    """Stage 3 without an optimizer: the model partitioned and gathered on use."""
    from deepspeed_c.runtime.zero.stage3 import Zero3Params

    return Zero3Params(engine.module, rank=engine.get_data_parallel_rank() if engine.dp_world_size > 1 else 0,
                       world_size=engine.dp_world_size, group=engine.data_parallel_group,
                       store_args=zero3_store_args(engine), zero_cfg=engine._config.zero_config)
