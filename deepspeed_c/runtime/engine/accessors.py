"""The engine's read-only config accessors (DeepSpeed's names; Hugging Face and user scripts call
them). Kept out of engine.py so the engine file holds only behaviour."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.runtime.config.precision import DEFAULT_LOWER_PRECISION_SAFE_MODULES
from deepspeed_c.runtime.config.zero import OffloadDeviceEnum, ZeroStageEnum


class EngineConfigAccessors:
    _config: Any

    # -- batch and schedule ----------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def steps_per_print(self) -> Any:
        return self._config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def get_batch_info(self) -> tuple[int, int, int]:
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps())

    # -- optimizer and scheduler -----------------------------------------------------------------
    def optimizer_name(self) -> Optional[str]:
        client = getattr(self, "client_optimizer", None)
        return client.__class__.__name__ if client else self._config.optimizer_name

    def optimizer_params(self) -> Optional[dict]:
        return self._config.optimizer_params

    def optimizer_legacy_fusion(self) -> bool:
        return self._config.optimizer_legacy_fusion

    def scheduler_name(self) -> Optional[str]:
        return self._config.scheduler_name

    def scheduler_params(self) -> Optional[dict]:
        return self._config.scheduler_params

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def sparse_gradients_enabled(self) -> bool:
        return self._config.sparse_gradients_enabled

    def graph_harvesting(self) -> bool:
        return self._config.graph_harvesting

    # -- ZeRO ------------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self._config.zero_enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    def zero_reduce_scatter(self) -> bool:
        return self._config.zero_config.reduce_scatter

    def zero_overlap_comm(self) -> bool:
        return self._config.zero_config.overlap_comm

    def zero_offload_optimizer(self) -> Any:
        return self._config.zero_config.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self._config.zero_config.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        off = self._config.zero_config.offload_optimizer
        return off is not None and off.device in (OffloadDeviceEnum.cpu.value, OffloadDeviceEnum.nvme.value)

    def zero_cpu_offload(self) -> bool:
        off = self._config.zero_config.offload_optimizer
        return off is not None and off.device == OffloadDeviceEnum.cpu.value

    def zero_sub_group_size(self) -> int:
        return self._config.zero_config.sub_group_size

    def zero_reduce_bucket_size(self) -> int:
        return self._config.zero_config.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self._config.zero_config.allgather_bucket_size

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return self._config.zero_config.use_multi_rank_bucket_allreduce

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= ZeroStageEnum.gradients

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= ZeroStageEnum.weights

    def zero_contiguous_gradients(self) -> bool:
        return self._config.zero_config.contiguous_gradients

    def zero_load_from_fp32_weights(self) -> bool:
        return self._config.zero_config.load_from_fp32_weights

    def zero_elastic_checkpoint(self) -> bool:
        return self._config.zero_config.elastic_checkpoint

    def zero_allgather_partitions(self) -> bool:
        return self._config.zero_config.allgather_partitions

    def zero_round_robin_gradients(self) -> bool:
        return self._config.zero_config.round_robin_gradients

    def zero_max_live_parameters(self) -> int:
        return self._config.zero_config.max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self._config.zero_config.max_reuse_distance

    def zero_prefetch_bucket_size(self) -> int:
        return self._config.zero_config.prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self._config.zero_config.param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self._config.zero_config.model_persistence_threshold

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_config.gather_16bit_weights_on_model_save

    def zero_ignore_unused_parameters(self) -> bool:
        return self._config.zero_config.ignore_unused_parameters

    def zero_legacy_stage1(self) -> bool:
        return self._config.zero_config.legacy_stage1

    def zero_hpz_partition_size(self) -> int:
        return self._config.zero_config.zero_hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        return self._config.zero_config.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self._config.zero_config.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        return self._config.zero_config.zero_quantized_gradients

    def mics_shard_size(self) -> int:
        return self._config.mics_shard_size

    # -- precision -------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self._config.float16_config.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bfloat16_config.enabled

    def fp16_auto_cast(self) -> bool:
        return self._config.float16_config.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._config.float16_config.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._config.bfloat16_config.bf16_master_weights_and_grads

    def amp_enabled(self) -> bool:
        return self._config.amp_enabled

    def amp_params(self) -> dict:
        return self._config.amp_params

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast_enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        return self._config.torch_autocast_dtype

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        names = self._config.torch_autocast_lower_precision_safe_modules
        return list(DEFAULT_LOWER_PRECISION_SAFE_MODULES) if names is None else list(names)

    def loss_scale(self) -> float:
        """The configured fp16.loss_scale (0 means dynamic), as DeepSpeed reports it."""
        return self._config.float16_config.loss_scale

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
        self._config.communication_data_type = value

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    # -- observability and checkpoint flags ------------------------------------------------------
    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return self._config.memory_breakdown

    def flops_profiler_enabled(self) -> bool:
        return self._config.flops_profiler_config.enabled

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self._config.flops_profiler_config.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self._config.flops_profiler_config.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self._config.flops_profiler_config.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self._config.flops_profiler_config.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self._config.flops_profiler_config.detailed

    def flops_profiler_output_file(self) -> Optional[str]:
        return self._config.flops_profiler_config.output_file

    def dump_state(self) -> bool:
        return self._config.dump_state

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint_tag_validation_enabled

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint_tag_validation_fail

    def checkpoint_serialization_enabled(self) -> bool:
        return self._config.checkpoint_config.checkpoint_serialization

    def use_node_local_storage(self) -> bool:
        return self._config.use_node_local_storage

    def load_universal_checkpoint(self) -> bool:
        return self._config.load_universal_checkpoint

    def elasticity_enabled(self) -> bool:
        return self._config.elasticity_enabled

    def pld_enabled(self) -> bool:
        return self._config.pld_enabled

    def eigenvalue_enabled(self) -> bool:
        return self._config.eigenvalue_enabled

    def curriculum_enabled_legacy(self) -> bool:
        return False

    def curriculum_learning_enabled(self) -> bool:
        return False

    def data_efficiency_enabled(self) -> bool:
        return False

    def random_ltd_enabled(self) -> bool:
        return False

    def autotuning_enabled(self) -> bool:
        return self._config.autotuning_config.enabled

    def autotp_size(self) -> int:
        return self._config.tensor_parallel_config.autotp_size

    def tensor_parallel_config(self) -> Any:
        return self._config.tensor_parallel_config
