"""The engine's read-only config accessors (DeepSpeed's names; Hugging Face and user scripts call
them). Kept out of engine.py so the engine file holds only behaviour.

Most of DeepSpeed's accessors return one config value: those are rows of CONFIG_ACCESSORS (name -> where
the value comes from), made into ordinary methods of EngineConfigAccessors when this module loads, so
`engine.zero_optimization_stage()`, `DeepSpeedEngine.zero_optimization_stage` and `help()` work as for a
method written out. The accessors that compute something stay written out in the class below."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from deepspeed_c.runtime.config.precision import DEFAULT_LOWER_PRECISION_SAFE_MODULES
from deepspeed_c.runtime.config.zero import OffloadDeviceEnum, ZeroStageEnum


@dataclass(frozen=True)
class Fixed:
    """An accessor whose answer does not depend on the config: the feature it reports is not part of
    deepspeed_c (why says which)."""
    value: Any
    why: str


# name -> (source, return type). source: a dotted attribute path under the engine's DeepSpeedConfig (read at
# each call, so set_train_batch_size and friends show through), or Fixed.
CONFIG_ACCESSORS: dict[str, tuple[Union[str, Fixed], Any]] = {
    # -- batch and schedule ----------------------------------------------------------------------
    "train_batch_size": ("train_batch_size", int),
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", int),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", int),
    "steps_per_print": ("steps_per_print", Any),
    "dataloader_drop_last": ("dataloader_drop_last", bool),
    # -- optimizer and scheduler -----------------------------------------------------------------
    "optimizer_params": ("optimizer_params", Optional[dict]),
    "optimizer_legacy_fusion": ("optimizer_legacy_fusion", bool),
    "scheduler_name": ("scheduler_name", Optional[str]),
    "scheduler_params": ("scheduler_params", Optional[dict]),
    "gradient_clipping": ("gradient_clipping", float),
    "sparse_gradients_enabled": ("sparse_gradients_enabled", bool),
    "graph_harvesting": ("graph_harvesting", bool),
    # -- ZeRO ------------------------------------------------------------------------------------
    "zero_optimization": ("zero_enabled", bool),
    "zero_optimization_stage": ("zero_optimization_stage", int),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer", bool),
    "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer", bool),
    "zero_reduce_scatter": ("zero_config.reduce_scatter", bool),
    "zero_overlap_comm": ("zero_config.overlap_comm", bool),
    "zero_offload_optimizer": ("zero_config.offload_optimizer", Any),
    "zero_offload_param": ("zero_config.offload_param", Any),
    "zero_sub_group_size": ("zero_config.sub_group_size", int),
    "zero_reduce_bucket_size": ("zero_config.reduce_bucket_size", int),
    "zero_allgather_bucket_size": ("zero_config.allgather_bucket_size", int),
    "zero_multi_rank_bucket_allreduce": ("zero_config.use_multi_rank_bucket_allreduce", bool),
    "zero_contiguous_gradients": ("zero_config.contiguous_gradients", bool),
    "zero_load_from_fp32_weights": ("zero_config.load_from_fp32_weights", bool),
    "zero_elastic_checkpoint": ("zero_config.elastic_checkpoint", bool),
    "zero_allgather_partitions": ("zero_config.allgather_partitions", bool),
    "zero_round_robin_gradients": ("zero_config.round_robin_gradients", bool),
    "zero_max_live_parameters": ("zero_config.max_live_parameters", int),
    "zero_max_reuse_distance": ("zero_config.max_reuse_distance", int),
    "zero_prefetch_bucket_size": ("zero_config.prefetch_bucket_size", int),
    "zero_param_persistence_threshold": ("zero_config.param_persistence_threshold", int),
    "zero_model_persistence_threshold": ("zero_config.model_persistence_threshold", int),
    "zero_module_granularity_threshold": ("zero_config.module_granularity_threshold", int),
    "zero_gather_16bit_weights_on_model_save": ("zero_config.gather_16bit_weights_on_model_save", bool),
    "zero_ignore_unused_parameters": ("zero_config.ignore_unused_parameters", bool),
    "zero_legacy_stage1": ("zero_config.legacy_stage1", bool),
    "zero_hpz_partition_size": ("zero_config.zero_hpz_partition_size", int),
    "zero_quantized_weights": ("zero_config.zero_quantized_weights", bool),
    "zero_quantized_nontrainable_weights": ("zero_config.zero_quantized_nontrainable_weights", bool),
    "zero_quantized_gradients": ("zero_config.zero_quantized_gradients", bool),
    "zeropp_loco_param": ("zero_config.zeropp_loco_param", Optional[dict]),
    "zero_allgather_sequential": ("zero_config.allgather_sequential", bool),
    "zero_log_trace_cache_warnings": ("zero_config.log_trace_cache_warnings", bool),
    "zero_save_muon_momentum_buffer_in_memory": ("zero_config.save_muon_momentum_buffer_in_memory", bool),
    "is_sanity_checks_enabled": ("zero_config.enable_sanity_checks", bool),
    "zenflow_config": ("zero_config.zenflow", Any),
    "mics_shard_size": ("mics_shard_size", int),
    "aio_config": ("aio_config", Any),
    # -- precision -------------------------------------------------------------------------------
    "fp16_enabled": ("float16_config.enabled", bool),
    "bfloat16_enabled": ("bfloat16_config.enabled", bool),
    "fp16_auto_cast": ("float16_config.auto_cast", bool),
    "fp16_master_weights_and_gradients": ("float16_config.fp16_master_weights_and_grads", bool),
    "bf16_master_weights_and_gradients": ("bfloat16_config.bf16_master_weights_and_grads", bool),
    "bf16_optimizer_states": ("bfloat16_config.bf16_optimizer_states", bool),
    "amp_enabled": ("amp_enabled", bool),
    "amp_params": ("amp_params", dict),
    "torch_autocast_enabled": ("torch_autocast_enabled", bool),
    "torch_autocast_dtype": ("torch_autocast_dtype", Optional[torch.dtype]),
    # fp16.loss_scale as configured, as DeepSpeed reports it: 0 means dynamic
    "loss_scale": ("float16_config.loss_scale", float),
    "gradient_predivide_factor": ("gradient_predivide_factor", float),
    # -- observability and checkpoint flags ------------------------------------------------------
    "wall_clock_breakdown": ("wall_clock_breakdown", bool),
    "memory_breakdown": ("memory_breakdown", bool),
    "flops_profiler_enabled": ("flops_profiler_config.enabled", bool),
    "flops_profiler_recompute_fwd_factor": ("flops_profiler_config.recompute_fwd_factor", float),
    "flops_profiler_profile_step": ("flops_profiler_config.profile_step", int),
    "flops_profiler_module_depth": ("flops_profiler_config.module_depth", int),
    "flops_profiler_top_modules": ("flops_profiler_config.top_modules", int),
    "flops_profiler_detailed": ("flops_profiler_config.detailed", bool),
    "flops_profiler_output_file": ("flops_profiler_config.output_file", Optional[str]),
    "dump_state": ("dump_state", bool),
    "checkpoint_tag_validation_enabled": ("checkpoint_tag_validation_enabled", bool),
    "checkpoint_tag_validation_fail": ("checkpoint_tag_validation_fail", bool),
    "checkpoint_serialization_enabled": ("checkpoint_config.checkpoint_serialization", bool),
    "use_node_local_storage": ("use_node_local_storage", bool),
    "load_universal_checkpoint": ("load_universal_checkpoint", bool),
    "elasticity_enabled": ("elasticity_enabled", bool),
    "pld_enabled": ("pld_enabled", bool),
    "pld_params": ("pld_params", Any),
    "pld_theta": ("pld_config.theta", float),
    "pld_gamma": ("pld_config.gamma", float),
    "eigenvalue_enabled": ("eigenvalue_enabled", bool),
    "eigenvalue_verbose": ("eigenvalue_config.verbose", bool),
    "eigenvalue_max_iter": ("eigenvalue_config.max_iter", int),
    "eigenvalue_tol": ("eigenvalue_config.tol", float),
    "eigenvalue_stability": ("eigenvalue_config.stability", float),
    "eigenvalue_gas_boundary_resolution": ("eigenvalue_config.gas_boundary_resolution", int),
    "eigenvalue_layer_name": ("eigenvalue_config.layer_name", str),
    "eigenvalue_layer_num": ("eigenvalue_config.layer_num", int),
    "curriculum_enabled_legacy": ("curriculum_enabled_legacy", bool),
    "curriculum_learning_enabled": ("curriculum_learning_enabled", bool),
    "data_efficiency_enabled": ("data_efficiency_enabled", bool),
    "random_ltd_enabled": ("random_ltd_enabled", bool),
    "autotuning_enabled": ("autotuning_config.enabled", bool),
    "autotuning_start_profile_step": ("autotuning_config.start_profile_step", int),
    "autotuning_end_profile_step": ("autotuning_config.end_profile_step", int),
    "autotuning_metric": ("autotuning_config.metric", str),
    "is_deepcompile_enabled": ("compile_config.deepcompile", bool),
    "autotp_size": ("tensor_parallel_config.autotp_size", int),
    "tensor_parallel_config": ("tensor_parallel_config", Any),
}


class EngineConfigAccessors:
    _config: Any
    parallel_dims: Any
    mpu: Any
    sequence_parallel_size: int

    def get_batch_info(self) -> tuple[int, int, int]:
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps())

    def optimizer_name(self) -> Optional[str]:
        client = getattr(self, "client_optimizer", None)
        return client.__class__.__name__ if client else self._config.optimizer_name

    # -- ZeRO ------------------------------------------------------------------------------------
    def zero_use_cpu_optimizer(self) -> bool:
        off = self._config.zero_config.offload_optimizer
        return off is not None and off.device in (OffloadDeviceEnum.cpu.value, OffloadDeviceEnum.nvme.value)

    def zero_cpu_offload(self) -> bool:
        off = self._config.zero_config.offload_optimizer
        return off is not None and off.device == OffloadDeviceEnum.cpu.value

    def zero_partial_offload(self) -> float:
        """offload_optimizer.ratio (1.0 without the section)."""
        return self._offload_optimizer_field("ratio", 1.0)

    def super_offload(self) -> bool:
        return self._offload_optimizer_field("super_offload", False)

    def cpuadam_cores_perc(self) -> float:
        return self._offload_optimizer_field("cpuadam_cores_perc", 0.9)

    def _offload_optimizer_field(self, name: str, without_section: Any) -> Any:
        off = self._config.zero_config.offload_optimizer
        return without_section if off is None else getattr(off, name)

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= ZeroStageEnum.gradients

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= ZeroStageEnum.weights

    def is_first_weights_partition_group(self) -> bool:
        """DeepSpeed's rule: at stage 3, true on every rank, except under MiCS, where only the first shard group
        (global ranks below mics_shard_size) writes the partitioned checkpoint files."""
        shard = self.mics_shard_size()
        if shard > 0:
            return self.global_rank < shard
        return self.zero_optimization_partition_weights()

    # -- DeepCompile passes (compile.passes: only "autosp" is built, the others are refused at config time) -
    def compile_zero_optimization_stage(self) -> bool:
        passes = self._config.compile_config.passes or []
        return "z1" in passes or "z3" in passes

    def compile_autosp(self) -> bool:
        return "autosp" in (self._config.compile_config.passes or [])

    def compile_autotp(self) -> bool:
        return "autotp" in (self._config.compile_config.passes or [])

    def uses_parallelization_pass_only(self) -> bool:
        return self.compile_autosp() or self.compile_autotp()

    # -- precision -------------------------------------------------------------------------------
    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        names = self._config.torch_autocast_lower_precision_safe_modules
        return list(DEFAULT_LOWER_PRECISION_SAFE_MODULES) if names is None else list(names)

    def dynamic_loss_scale(self) -> bool:
        return self._config.float16_config.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return self._config.float16_config.initial_dynamic_scale()

    def dynamic_loss_scale_args(self) -> dict:
        return self._config.float16_config.dynamic_loss_scale_args()

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        model_dtype = self._config.model_dtype()
        grad_accum = self._config.grad_accum_dtype
        from deepspeed_c.runtime.config.utils import parse_dtype

        return model_dtype, (parse_dtype(grad_accum, "data_types.grad_accum_dtype") or model_dtype)

    @property
    def communication_data_type(self) -> torch.dtype:
        if self._config.communication_data_type is not None:
            return self._config.communication_data_type
        if self.fp16_enabled():
            return torch.float16
        if self.bfloat16_enabled():
            return torch.bfloat16
        return torch.float32

    @communication_data_type.setter
    def communication_data_type(self, value: torch.dtype) -> None:
        self._config.set_communication_data_type(value)

    @property
    def gradient_average(self) -> bool:
        """Data-parallel gradients averaged (True: gradient_allreduce_op "mean") or summed."""
        return self.__dict__.get("_gradient_average", True)

    @gradient_average.setter
    def gradient_average(self, value: bool) -> None:
        # DeepSpeed reads engine.gradient_average at every reduction (its tests assign it after initialize):
        # the engine's own reducers follow; ZeRO's keep their setting, as DeepSpeed's ZeRO optimizers,
        # which copy it when they are built
        self.__dict__["_gradient_average"] = bool(value)
        reducer = self.__dict__.get("reducer")
        stepper = self.__dict__.get("stepper")
        owned = stepper.owned_reducer() if stepper is not None else None
        if reducer is not None and reducer is not owned and hasattr(reducer, "set_gradient_average"):
            reducer.set_gradient_average(bool(value))

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    @property
    def sparse_tensor_module_names(self) -> set:
        """DeepSpeed 0.19.6's set of "<module>.weight" names exchanged as sparse rows (sparse_gradients on),
        restored by load_checkpoint (runtime/sparse_names.py)."""
        return self.sparse_names.names

    @sparse_tensor_module_names.setter
    def sparse_tensor_module_names(self, value: Any) -> None:
        self.sparse_names.replace(value)

    # -- parallel layout (DeepSpeed's engine attributes, read from the one ParallelDims) ---------------
    @property
    def mp_world_size(self) -> int:
        """DeepSpeed's model-parallel world size: a client mpu's (its mp_rank_XX checkpoint files), else 1."""
        return self.parallel_dims.model

    @property
    def checkpoint_mp_rank(self) -> int:
        """The XX of this rank's mp_rank_XX checkpoint files (0 without a model-parallel mpu)."""
        return self.parallel_dims.model_rank

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks of the sequence-data-parallel group (data x sequence under Ulysses, else the data-parallel
        world): what ZeRO partitions and gradient reductions span."""
        return self.parallel_dims.data

    @property
    def seq_data_parallel_group(self) -> Any:
        return self.parallel_dims.data_group

    @property
    def seq_parallel_group(self) -> Any:
        """The Ulysses sequence-parallel group of this rank (DeepSpeed sets it only when
        sequence_parallel_size > 1; None here otherwise)."""
        return self.get_sequence_parallel_group()

    def get_sequence_parallel_group(self) -> Any:
        mpu = self.mpu
        if self.sequence_parallel_size <= 1 or not hasattr(mpu, "get_sequence_parallel_group"):
            return None
        return mpu.get_sequence_parallel_group()

    # -- observability and checkpoint flags ------------------------------------------------------
    def checkpoint_writer_enabled(self) -> bool:
        return self._config.checkpoint_config.writer is not None

    def autotuning_profile_model_info(self) -> bool:
        info = self._config.autotuning_config.model_info
        return bool(self._config.autotuning_config.enabled and info and info.get("profile", False))


def _accessor(name: str, source: Union[str, Fixed], returns: Any) -> Callable[[Any], Any]:
    if isinstance(source, Fixed):
        value = source.value

        def accessor(self: Any) -> Any:
            return value

        doc = f"Always {value!r}: {source.why} (DeepSpeed's engine.{name}())."
    else:
        read = operator.attrgetter(source)

        def accessor(self: Any) -> Any:
            return read(self._config)

        doc = f"The config's `{source}` (DeepSpeed's engine.{name}())."
    accessor.__name__ = name
    accessor.__qualname__ = f"{EngineConfigAccessors.__qualname__}.{name}"
    accessor.__doc__ = doc
    accessor.__annotations__ = {"return": returns}
    return accessor


def _install(cls: type, table: dict[str, tuple[Union[str, Fixed], Any]]) -> None:
    for name, (source, returns) in table.items():
        if name in vars(cls):
            raise TypeError(f"{cls.__name__}.{name} is written out and also a row of CONFIG_ACCESSORS")
        setattr(cls, name, _accessor(name, source, returns))


_install(EngineConfigAccessors, CONFIG_ACCESSORS)
