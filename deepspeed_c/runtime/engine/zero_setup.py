"""The engine building its ZeRO stage 1/2/3 optimizer (or, at stage 3 without an optimizer, its
partitioned parameter store) from the config: DeepSpeedEngine._configure_zero calls these. They read
the engine's public attributes; the config and the engine's reduce predicate come as arguments. The
config-only pieces live in deepspeed_c/runtime/zero/optimizer_inputs.py."""
from __future__ import annotations

from typing import Any, Callable

import torch

from deepspeed_c.runtime.config.utils import parse_dtype
from deepspeed_c.runtime.zero.optimizer_inputs import (check_optimizer, master_dtype, nvme_offload_args,
                                                       offload_threads, zero3_store_args)


def _dp_rank(engine: Any) -> int:
    return engine.get_data_parallel_rank() if engine.dp_world_size > 1 else 0


def configure_zero_optimizer(engine: Any, config: Any, should_reduce_at_boundary: Callable[[], bool]) -> Any:
    """Replaces the engine's (possibly mixed-precision wrapped) optimizer by the ZeRO optimizer.
    config: the engine's DeepSpeedConfig; should_reduce_at_boundary: stages 0/1's reduce predicate
    (backward all-reduce on, outside no_sync, at the accumulation boundary)."""
    from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_c.runtime.sparse_grads import check_sparse_supported, sparse_module_names

    stage = engine.zero_optimization_stage()
    check_sparse_supported(sparse_module_names(engine.module), f"zero_optimization.stage={stage}")
    basic = engine.basic_optimizer
    if engine.precision.grad_scaler is not None:
        raise NotImplementedError("deepspeed_c: torch_autocast with fp16 is not supported together with "
                                  f"zero_optimization.stage={stage}; use the fp16 section instead")
    check_optimizer(basic, allow_untested=engine.zero_allow_untested_optimizer(),
                    require_cpu_optimizer=bool(engine.zero_use_cpu_optimizer() and engine.client_optimizer is not None
                                               and engine.zero_force_ds_cpu_optimizer()))
    zero_cfg = config.zero_config
    # DeepSpeed's stage 1/2 optimizer starts each all-gather on a 4-byte boundary of 16-bit elements
    nccl_start_alignment_factor = 2
    if zero_cfg.allgather_bucket_size % nccl_start_alignment_factor != 0:
        raise AssertionError(f"allgather_bucket_size must be a multiple of nccl_start_alignment_factor, "
                             f"{nccl_start_alignment_factor} (zero_optimization.allgather_bucket_size="
                             f"{zero_cfg.allgather_bucket_size})")
    # the precision collaborator left the optimizer unwrapped (ZeRO owns the masters): only its scaling
    loss_scaler, check_overflow = engine.precision.zero_loss_scaling()
    offload = zero_cfg.offload_optimizer
    offload_device = "cpu" if engine.zero_use_cpu_optimizer() else None  # nvme: the host steps, files hold state
    if offload_device is not None and config.bfloat16_config.enabled and config.bfloat16_config.bf16_optimizer_states:
        _bf16_offloaded_moments(basic, client_built=engine.client_optimizer is not None,
                                optimizer_params=config.optimizer_params)
    elif config.bfloat16_config.enabled and config.bfloat16_config.bf16_optimizer_states and _fp32_moments_only(basic):
        from deepspeed_c.utils.logging import logger

        logger.warning(f"bf16.bf16_optimizer_states: {type(basic).__name__} keeps its moments in fp32 (deepspeed_c's "
                       "fused kernels have no bf16-moment variant; DeepSpeed's keep them in the masters' bf16); "
                       "ZeRO-Offload's DeepSpeedCPUAdam (zero_optimization.offload_optimizer) keeps them in bf16")
    if stage >= 2:
        # gradient partitioning: every micro-step's gradients are reduced into the partition (no_sync is
        # refused at stage 2, as in DeepSpeed)
        def should_reduce() -> bool:
            return bool(engine.enable_backward_allreduce)
    else:
        should_reduce = should_reduce_at_boundary
    rank = _dp_rank(engine)
    common = dict(
        rank=rank, world_size=engine.dp_world_size, should_reduce=should_reduce,
        is_boundary=engine.is_gradient_accumulation_boundary, reduce_scatter=bool(zero_cfg.reduce_scatter),
        dp_process_group=engine.data_parallel_group, reduce_bucket_size=zero_cfg.reduce_bucket_size,
        allgather_bucket_size=zero_cfg.allgather_bucket_size, clip_grad=engine.gradient_clipping(),
        loss_scaler=loss_scaler, check_overflow=check_overflow,
        communication_dtype=engine.communication_data_type, offload_device=offload_device,
        pin_memory=bool(offload is not None and offload.pin_memory),
        overlap_comm=zero_cfg.overlap_comm if "overlap_comm" in zero_cfg.model_fields_set else None,
        ignore_unused_parameters=bool(zero_cfg.ignore_unused_parameters), offload_threads=offload_threads(zero_cfg),
        prescale_gradients=config.prescale_gradients, gradient_predivide_factor=config.gradient_predivide_factor,
        gradient_average=engine.gradient_average, master_dtype=master_dtype(config),
        # DeepSpeed's BF16_Optimizer case: stage 1, bf16 model, fp32 accumulation, no offload
        accumulate_fp32=(stage == 1 and engine.precision.model_dtype == torch.bfloat16 and offload_device is None
                         and parse_dtype(config.grad_accum_dtype, "data_types.grad_accum_dtype") == torch.float32),
        nvme_offload=nvme_offload_args(zero_cfg, config.aio_config, stage, rank))
    _check_fits(engine, stage, basic, zero_cfg)
    sp = engine.parallel_dims.sequence  # Ulysses: gradients summed over the sequence ranks
    if engine.has_moe_layers:
        if zero_cfg.zenflow is not None:
            raise NotImplementedError("zero_optimization.zenflow with MoE layers is not built; remove "
                                      "'zero_optimization.zenflow' to use ZeRO-Offload")
        if stage == 3:
            raise NotImplementedError("zero_optimization.stage 3 with MoE layers is not built (DeepSpeed 0.19.8 refuses "
                                      "its native MoE layers at stage 3 too); use stage 0, 1 or 2")
        from deepspeed_c.runtime.zero.moe_zero import configure_moe_zero_optimizer

        optimizer = configure_moe_zero_optimizer(basic, engine.moe, stage, common)
        engine.precision.set_scaling_owner(optimizer)
        return optimizer
    if stage == 3:
        from deepspeed_c.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        stage3_cls: Any = DeepSpeedZeroOptimizer_Stage3
        extra3: dict[str, Any] = {}
        if offload is not None and offload.super_offload:  # the host step speculates during backward
            from deepspeed_c.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3 as stage3_cls
        elif zero_cfg.mics_shard_size > 0:  # MiCS: sharded inside groups of mics_shard_size, replicated across
            _check_mics_parallelism(engine, config)
            from deepspeed_c.runtime.zero.mics import MiCS_Optimizer as stage3_cls
        elif zero_cfg.zenflow is not None:
            from deepspeed_c.runtime.zenflow.engine_stage3 import ZenFlowZeroOptimizer_Stage3 as stage3_cls
            from deepspeed_c.runtime.zenflow.zenflow_config import resolve_schedule

            loader = engine.training_dataloader
            extra3["zenflow"] = resolve_schedule(zero_cfg.zenflow, len(loader) if loader is not None else None)
        optimizer = stage3_cls(engine.module, basic, store_args=_store_args(engine, zero_cfg), zero_cfg=zero_cfg,
                               sequence_parallel_size=sp, **common, **extra3)
    else:
        zero_cls: Any = DeepSpeedZeroOptimizer
        extra: dict[str, Any] = {}
        if zero_cfg.zenflow is not None:  # ZeRO-Offload whose device steps the top-k gradient columns
            from deepspeed_c.runtime.zenflow.zenflow_config import resolve_schedule
            from deepspeed_c.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizer as zero_cls

            loader = engine.training_dataloader
            extra["zenflow"] = resolve_schedule(zero_cfg.zenflow, len(loader) if loader is not None else None)
        optimizer = zero_cls(basic, stage=stage, sequence_parallel_size=sp, **common, **extra)
        if zero_cfg.contiguous_gradients:  # Linear weight gradients computed straight into their bucket slots
            optimizer.reducer.install_direct_linears(engine.module)
    if engine.parallel_dims.tensor_parallel:
        # the norm of the unsharded model: shards summed over TP, replicas once (every rank: data x tensor)
        optimizer.set_tensor_parallel_norm(engine.parallel_dims.tensor, group=None)
    engine.precision.set_scaling_owner(optimizer)  # loss scaling reads cur_scale / note_backward_scale here
    return optimizer


def _fp32_moments_only(basic: Any) -> bool:
    """deepspeed_c's fused optimizers (FusedAdam, FusedLion, FusedLamb) keep float32 moments whatever the
    parameter dtype."""
    cls = type(basic)
    return cls.__module__.startswith("deepspeed_c.ops.") and cls.__name__.startswith("Fused")


def _bf16_offloaded_moments(basic: Any, client_built: bool, optimizer_params: Any) -> None:
    """bf16.bf16_optimizer_states under ZeRO-Offload, as DeepSpeed: the host optimizer keeps its moments
    in the masters' bf16. One the engine built is switched to fp32_optimizer_states=False before its
    first step (a configured `fp32_optimizer_states: true` is overridden, with a warning); a client's
    must have been built so, else the moments would silently stay fp32."""
    if not client_built and getattr(basic, "fp32_optimizer_states", None) is True:
        if isinstance(optimizer_params, dict) and optimizer_params.get("fp32_optimizer_states"):
            from deepspeed_c.utils.logging import logger

            logger.warning("bf16.bf16_optimizer_states is enabled: overriding optimizer.params.fp32_optimizer_states "
                           "to False so the offloaded optimizer's moments are kept in bf16")
        basic.set_fp32_optimizer_states(False)
    assert not getattr(basic, "fp32_optimizer_states", True), (
        "bf16.bf16_optimizer_states with ZeRO-Offload (zero_optimization.offload_optimizer) needs the client "
        "optimizer to be a DeepSpeedCPUAdam built with fp32_optimizer_states=False, so its moments are kept in bf16; "
        f"got {type(basic).__name__} with fp32_optimizer_states={getattr(basic, 'fp32_optimizer_states', None)}")


def _check_fits(engine: Any, stage: int, basic: Any, zero_cfg: Any, training: bool = True) -> None:
    """A model whose ZeRO model states cannot fit the device or the host is refused now, naming the figures
    (runtime/zero/fit_check.py), not by an out-of-memory error mid-allocation. training=False (stage 3 without
    an optimizer): the weights alone."""
    import os

    from deepspeed_c.runtime.zero import fit_check
    from deepspeed_c.runtime.zero.stage3_estimators import model_to_params

    if engine.has_moe_layers:  # experts are split over the expert-parallel group: not this estimate
        return
    params, largest = model_to_params(engine.module)
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()
                    if p.requires_grad) if training else 0
    world = max(1, engine.dp_world_size)
    local = min(world, max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    def where(section: Any) -> Any:  # "cpu" / "nvme", or None when not offloaded
        device = getattr(getattr(section, "device", None), "value", getattr(section, "device", None))
        return None if device in (None, "none") else str(device)

    off_opt, off_par = where(zero_cfg.offload_optimizer), where(zero_cfg.offload_param)
    need = fit_check.lower_bounds(stage, params, trainable, largest, world, local,
                                  torch.finfo(engine.precision.model_dtype).bits // 8,
                                  fit_check.optimizer_state_bytes(basic),
                                  off_opt, off_par if stage >= 3 else None)
    fit_check.check(need, stage, params, fit_check.device_capacity(torch.device(engine.device)),
                    fit_check.host_capacity(), off_opt, off_par if stage >= 3 else None)


def _store_args(engine: Any, zero_cfg: Any) -> dict:
    return zero3_store_args(zero_cfg, engine.precision.model_dtype, engine.device)


def configure_zero3_params(engine: Any, config: Any) -> Any:
    """Stage 3 without an optimizer: the model partitioned and gathered on use."""
    from deepspeed_c.runtime.zero.stage3 import Zero3Params

    zero_cfg = config.zero_config
    _check_fits(engine, 3, None, zero_cfg, training=False)
    if zero_cfg.mics_shard_size > 0:
        from deepspeed_c.runtime.zero.mics import mics_zero3_params

        _check_mics_parallelism(engine, config)
        return mics_zero3_params(engine.module, zero_cfg=zero_cfg, group=engine.data_parallel_group,
                                 store_args=_store_args(engine, zero_cfg))
    return Zero3Params(engine.module, rank=_dp_rank(engine), world_size=engine.dp_world_size,
                       group=engine.data_parallel_group, store_args=_store_args(engine, zero_cfg), zero_cfg=zero_cfg)


def _check_mics_parallelism(engine: Any, config: Any) -> None:
    """MiCS is built over plain data parallelism and the eager backward: its replica all-reduce and norms assume
    no tensor or sequence ranks inside the data-parallel group, and run after the eager reducer's round (which
    DeepCompile's in-graph reduce-scatters bypass)."""
    if engine.parallel_dims.tensor_parallel or engine.parallel_dims.sequence > 1:
        raise NotImplementedError("deepspeed_c: zero_optimization.mics_shard_size (MiCS) with tensor or sequence "
                                  "parallelism is not built; remove mics_shard_size to run plain ZeRO-3")
    if bool(getattr(config.compile_config, "deepcompile", False)):
        raise NotImplementedError("deepspeed_c: zero_optimization.mics_shard_size (MiCS) with compile.deepcompile "
                                  "is not built; remove one of the two")
