"""The remaining typed sections (checkpoint, activation checkpointing, flops profiler, timers,
compile, tensor parallel, eigenvalue, progressive layer drop) and the gate for sections whose
capability is not built: those raise NotImplementedError naming their key path when they ask
for the capability, and are accepted when they only restate "off"."""
from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from pydantic import Field, field_validator

from deepspeed_c.runtime.config.utils import (DeepSpeedConfigError, DeepSpeedConfigModel, closest, config_warning,
                                              model_keys, parse_section, unbuilt)


class ValidationMode(str, Enum):
    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


class ParallelWriteConfig(DeepSpeedConfigModel):
    pipeline_stage: bool = False


class CheckpointConfig(DeepSpeedConfigModel):
    tag_validation: ValidationMode = ValidationMode.WARN
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: Optional[dict[str, Any]] = None

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class ActivationCheckpointingConfig(DeepSpeedConfigModel):
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class FlopsProfilerConfig(DeepSpeedConfigModel):
    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: Optional[str] = None


class ThroughputTimerConfig(DeepSpeedConfigModel):
    enabled: bool = True
    synchronized: bool = True


class TimersConfig(DeepSpeedConfigModel):
    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class CompileConfig(DeepSpeedConfigModel):
    deepcompile: bool = False
    free_activation: bool = False
    free_activation_threshold: int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: Optional[list[str]] = None


class TPTrainingConfig(DeepSpeedConfigModel):
    dtype: Optional[str] = None
    autotp_size: int = Field(0, ge=0)
    tp_overlap_comm: bool = False
    partition_config: Optional[dict[str, Any]] = None
    preset_model: Optional[str] = None
    keep_module_on_host: bool = False
    tensor_parallel: Optional[dict[str, Any]] = None
    injection_policy_tuple: Optional[Any] = None


class EigenvalueConfig(DeepSpeedConfigModel):
    enabled: bool = False
    verbose: bool = False
    max_iter: int = 100
    tol: float = 1e-2
    stability: float = 1e-6
    gas_boundary_resolution: int = 1
    layer_name: str = "bert.encoder.layer"
    layer_num: int = 0


class ProgressiveLayerDropConfig(DeepSpeedConfigModel):
    enabled: bool = False
    theta: float = 1.0
    gamma: float = 0.001


class PipelineConfig(DeepSpeedConfigModel):
    """The `pipeline` section (DeepSpeed's keys, plus schedule/virtual_stages of deepspeed_c)."""
    stages: Any = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    schedule: str = "1f1b"
    virtual_stages: int = 1


# Sections deepspeed_c does not build: (what, whether this raw section asks for it).
def _enabled(raw: Any) -> bool:
    return isinstance(raw, dict) and bool(raw.get("enabled", False))


def _present(raw: Any) -> bool:
    return raw is not None and raw != {} and raw is not False


UNBUILT_SECTIONS: dict[str, tuple[str, Any]] = {
    "weight_quantization": ("weight quantization", _present),
    "elasticity": ("elastic training", _enabled),
    "nebula": ("Nebula checkpointing", _enabled),
}


def check_unbuilt_sections(param_dict: dict[str, Any]) -> None:
    for key, (what, asks) in UNBUILT_SECTIONS.items():
        if key in param_dict and asks(param_dict[key]):
            raise unbuilt(key, what)
    zero = param_dict.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if param_dict.get("sparse_gradients", False) is True and stage:
        raise ValueError(f"sparse_gradients: sparse embedding gradients are exchanged at zero_optimization.stage 0 "
                         f"only (got stage {stage}); ZeRO partitions dense gradients")


def _known_keys_only(cls: type, raw: Any, path: str) -> Any:
    """DeepSpeed reads some sections key by key (get_scalar_param), so a key it does not know there
    is silently unused; here it is dropped with a warning naming the closest valid key."""
    if not isinstance(raw, dict):
        return raw
    valid = model_keys(cls)
    for key in raw:
        if key not in valid:
            near = closest(str(key), valid)
            hint = f" (did you mean '{near}'?)" if near else ""
            config_warning(f"Unknown config key '{path}.{key}' is ignored{hint}")
    return {k: v for k, v in raw.items() if k in valid}


def parse_misc_sections(param_dict: dict[str, Any]) -> dict[str, Any]:
    check_unbuilt_sections(param_dict)
    flops = parse_section(FlopsProfilerConfig, _known_keys_only(FlopsProfilerConfig, param_dict.get("flops_profiler"),
                                                                 "flops_profiler"), "flops_profiler")
    from deepspeed_c.autotuning.config import parse_autotuning

    autotuning = parse_autotuning(param_dict.get("autotuning"))
    eigen = parse_section(EigenvalueConfig, param_dict.get("eigenvalue"), "eigenvalue")
    if eigen.enabled and not (param_dict.get("quantize_training") or {}).get("enabled"):
        # the eigenvalues time MoQ's precision drops (compression/engine_hooks.py) and nothing else, in DeepSpeed
        # too (it never reads the section otherwise)
        config_warning("Config key 'eigenvalue.enabled' has no effect without 'quantize_training.enabled' (MoQ): "
                       "the blocks' Hessian eigenvalues only stretch MoQ's quantize_period")
    pld = parse_section(ProgressiveLayerDropConfig, param_dict.get("progressive_layer_drop"),
                        "progressive_layer_drop")
    compile_cfg = parse_section(CompileConfig, param_dict.get("compile"), "compile")
    from deepspeed_c.runtime.config.deepcompile import check_deepcompile

    check_deepcompile(compile_cfg, param_dict)
    tp = parse_section(TPTrainingConfig, param_dict.get("tensor_parallel"), "tensor_parallel")  # AutoTP: initialize
    if tp.autotp_size > 1:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % tp.autotp_size != 0:
            raise DeepSpeedConfigError(f"Invalid value {tp.autotp_size} for config key 'tensor_parallel.autotp_size': "
                                       f"it must divide the world size ({world})")
    checkpoint = parse_section(CheckpointConfig, param_dict.get("checkpoint"), "checkpoint")
    act = parse_section(ActivationCheckpointingConfig, param_dict.get("activation_checkpointing"),
                        "activation_checkpointing")
    if act.number_checkpoints is not None and act.number_checkpoints < 0:
        raise DeepSpeedConfigError(f"Invalid value {act.number_checkpoints!r} for config key "
                                   f"'activation_checkpointing.number_checkpoints': expected an int >= 0")
    timers = parse_section(TimersConfig, param_dict.get("timers"), "timers")
    pipeline = parse_section(PipelineConfig, param_dict.get("pipeline"), "pipeline")
    if pipeline.schedule not in ("1f1b", "interleaved", "zb_h1"):
        raise DeepSpeedConfigError(f"Invalid value {pipeline.schedule!r} for config key 'pipeline.schedule': "
                                   "expected '1f1b', 'interleaved' or 'zb_h1'")
    from deepspeed_c.runtime.data_pipeline.config import parse_curriculum_legacy

    curriculum_enabled, curriculum_params = parse_curriculum_legacy(param_dict)
    from deepspeed_c.runtime.data_pipeline.config import parse_data_efficiency

    data_efficiency = parse_data_efficiency(param_dict)
    from deepspeed_c.compression.config import get_compression_config  # bad keys fail here, naming the closest
    from deepspeed_c.compression.moq import parse_quantize_training

    compression_config = get_compression_config(param_dict)
    parse_quantize_training(param_dict)
    from deepspeed_c.ops.sparse_attention.config import parse_sparse_attention

    return {
        "sparse_attention": parse_sparse_attention(param_dict.get("sparse_attention")),
        "pipeline_config": pipeline, "compression_config": compression_config,
        "curriculum_enabled_legacy": curriculum_enabled, "curriculum_params_legacy": curriculum_params,
        **data_efficiency,
        "flops_profiler_config": flops, "autotuning_config": autotuning, "eigenvalue_config": eigen, "pld_config": pld,
        "compile_config": compile_cfg, "tensor_parallel_config": tp, "checkpoint_config": checkpoint,
        "activation_checkpointing_config": act, "timers_config": timers,
    }
