"""The engine's config accessors: the rows of accessors.CONFIG_ACCESSORS become real methods of the engine
class that answer from the config; DeepSpeed's accessor names are all there."""
from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.engine import DeepSpeedEngine
from deepspeed_c.runtime.engine.accessors import CONFIG_ACCESSORS, EngineConfigAccessors, Fixed
from tests.distributed.engine_models import MLP

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks

# DeepSpeed 0.19's DeepSpeedEngine accessors (the methods that report the config or the engine's set-up),
# by name; /work/shared/reference/seed-api-inventory.md section 2 names the ones tutorials use.
DEEPSPEED_ACCESSORS = """
get_batch_info train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print
dataloader_drop_last optimizer_name optimizer_params optimizer_legacy_fusion scheduler_name scheduler_params
gradient_clipping sparse_gradients_enabled graph_harvesting
zero_optimization zero_optimization_stage zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
zero_reduce_scatter zero_overlap_comm zero_offload_optimizer zero_offload_param zero_use_cpu_optimizer
zero_cpu_offload zero_partial_offload super_offload cpuadam_cores_perc zero_sub_group_size
zero_reduce_bucket_size zero_allgather_bucket_size zero_multi_rank_bucket_allreduce
zero_optimization_partition_gradients zero_optimization_partition_weights zero_contiguous_gradients
zero_load_from_fp32_weights zero_elastic_checkpoint zero_allgather_partitions zero_round_robin_gradients
zero_max_live_parameters zero_max_reuse_distance zero_prefetch_bucket_size zero_param_persistence_threshold
zero_model_persistence_threshold zero_module_granularity_threshold zero_gather_16bit_weights_on_model_save
zero_ignore_unused_parameters zero_legacy_stage1 zero_hpz_partition_size zero_quantized_weights
zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param zero_allgather_sequential
zero_log_trace_cache_warnings zero_save_muon_momentum_buffer_in_memory is_sanity_checks_enabled zenflow_config
mics_shard_size aio_config compile_zero_optimization_stage compile_autosp compile_autotp
uses_parallelization_pass_only is_deepcompile_enabled is_deepcompile_active
fp16_enabled bfloat16_enabled fp16_auto_cast fp16_master_weights_and_gradients bf16_master_weights_and_gradients
bf16_optimizer_states amp_enabled amp_params torch_autocast_enabled torch_autocast_dtype
torch_autocast_lower_precision_safe_modules loss_scale dynamic_loss_scale initial_dynamic_scale
dynamic_loss_scale_args get_data_types communication_data_type postscale_gradients gradient_predivide_factor
wall_clock_breakdown memory_breakdown flops_profiler_enabled flops_profiler_recompute_fwd_factor
flops_profiler_profile_step flops_profiler_module_depth flops_profiler_top_modules flops_profiler_detailed
flops_profiler_output_file dump_state checkpoint_tag_validation_enabled checkpoint_tag_validation_fail
checkpoint_serialization_enabled checkpoint_writer_enabled use_node_local_storage load_universal_checkpoint
elasticity_enabled pld_enabled pld_params pld_theta pld_gamma eigenvalue_enabled eigenvalue_verbose
eigenvalue_max_iter eigenvalue_tol eigenvalue_stability eigenvalue_gas_boundary_resolution eigenvalue_layer_name
eigenvalue_layer_num curriculum_enabled_legacy curriculum_learning_enabled data_efficiency_enabled
random_ltd_enabled autotuning_enabled autotuning_start_profile_step autotuning_end_profile_step autotuning_metric
autotuning_profile_model_info autotp_size tensor_parallel_config
get_global_grad_norm was_step_applied get_lr get_mom get_type get_wall_clock_timers
get_data_parallel_rank get_model_parallel_rank get_tensor_parallel_rank
""".split()

# Two configs that set the keys behind the generated accessors to different values.
CONFIGS = {
    "fp32_stage0": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "gradient_clipping": 0.0, "dataloader_drop_last": False, "wall_clock_breakdown": False,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 0},
        "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1},
        "checkpoint": {"tag_validation": "WARN"},
        "progressive_layer_drop": {"enabled": False, "theta": 0.5, "gamma": 0.01},
        "eigenvalue": {"max_iter": 100, "tol": 0.01, "layer_num": 0},
    },
    "bf16_zero2_offload": {
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "steps_per_print": 7,
        "gradient_clipping": 0.5, "dataloader_drop_last": True, "wall_clock_breakdown": True,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": False,
                              "reduce_bucket_size": 12345, "allgather_bucket_size": 23456,
                              "round_robin_gradients": True, "sub_group_size": 4321,
                              "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}},
        "flops_profiler": {"enabled": False, "profile_step": 3, "module_depth": 2, "top_modules": 4,
                           "output_file": "/dev/null"},
        "checkpoint": {"tag_validation": "FAIL"},
        "progressive_layer_drop": {"enabled": False, "theta": 0.25, "gamma": 0.02},
        "eigenvalue": {"max_iter": 7, "tol": 0.5, "layer_num": 3},
    },
}

# generated accessor -> its key in the user's JSON config (the configs above set each one differently)
JSON_KEYS: dict[str, tuple[str, ...]] = {
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "steps_per_print": ("steps_per_print",),
    "gradient_clipping": ("gradient_clipping",),
    "dataloader_drop_last": ("dataloader_drop_last",),
    "wall_clock_breakdown": ("wall_clock_breakdown",),
    "optimizer_params": ("optimizer", "params"),
    "bfloat16_enabled": ("bf16", "enabled"),
    "zero_optimization_stage": ("zero_optimization", "stage"),
    "zero_overlap_comm": ("zero_optimization", "overlap_comm"),
    "zero_contiguous_gradients": ("zero_optimization", "contiguous_gradients"),
    "zero_reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "zero_allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "zero_round_robin_gradients": ("zero_optimization", "round_robin_gradients"),
    "zero_sub_group_size": ("zero_optimization", "sub_group_size"),
    "flops_profiler_profile_step": ("flops_profiler", "profile_step"),
    "flops_profiler_module_depth": ("flops_profiler", "module_depth"),
    "flops_profiler_top_modules": ("flops_profiler", "top_modules"),
    "pld_enabled": ("progressive_layer_drop", "enabled"),
    "pld_theta": ("progressive_layer_drop", "theta"),
    "pld_gamma": ("progressive_layer_drop", "gamma"),
    "eigenvalue_max_iter": ("eigenvalue", "max_iter"),
    "eigenvalue_tol": ("eigenvalue", "tol"),
    "eigenvalue_layer_num": ("eigenvalue", "layer_num"),
}


def _config_value(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine_and_json(request):
    torch.manual_seed(0)
    cfg = CONFIGS[request.param]
    engine, *_ = deepspeed_c.initialize(model=MLP(), model_parameters=None, config=cfg)
    yield engine, cfg
    engine.destroy()


def test_every_deepspeed_accessor_is_on_the_engine():
    missing = [n for n in DEEPSPEED_ACCESSORS if not hasattr(DeepSpeedEngine, n)]
    assert not missing, missing
    generated = set(CONFIG_ACCESSORS)
    assert generated <= set(DEEPSPEED_ACCESSORS), sorted(generated - set(DEEPSPEED_ACCESSORS))


def test_generated_accessors_are_methods_with_a_docstring():
    for name, (source, _) in CONFIG_ACCESSORS.items():
        fn = vars(EngineConfigAccessors)[name]
        assert inspect.isfunction(fn) and DeepSpeedEngine.__dict__.get(name) is None, name
        assert getattr(DeepSpeedEngine, name) is fn
        assert fn.__name__ == name and fn.__qualname__ == f"EngineConfigAccessors.{name}"
        assert list(inspect.signature(fn).parameters) == ["self"], name
        assert name in fn.__doc__ and (isinstance(source, Fixed) or source in fn.__doc__), fn.__doc__


def test_generated_accessors_answer_from_the_config(engine_and_json):
    engine, _ = engine_and_json
    for name, (source, _) in CONFIG_ACCESSORS.items():
        got = getattr(engine, name)()
        want = source.value if isinstance(source, Fixed) else _config_value(engine._config, source)
        assert got is want or got == want, (name, got, want)


def test_generated_accessors_follow_the_json(engine_and_json):
    engine, cfg = engine_and_json
    assert set(JSON_KEYS) <= set(CONFIG_ACCESSORS)
    checked = 0
    for name, keys in JSON_KEYS.items():
        section: Any = cfg
        for key in keys:
            section = section.get(key) if isinstance(section, dict) else None
        if section is None:
            continue
        got = getattr(engine, name)()
        if name == "optimizer_params":
            got = {k: got[k] for k in section}
        assert got == section, (name, got, section)
        checked += 1
    assert checked >= 15, checked


def test_written_out_accessors_follow_the_json(engine_and_json):
    engine, cfg = engine_and_json
    zero = cfg["zero_optimization"]
    offload = zero.get("offload_optimizer")
    assert engine.get_batch_info() == (engine.train_batch_size(), cfg["train_micro_batch_size_per_gpu"],
                                       cfg["gradient_accumulation_steps"])
    assert engine.train_batch_size() == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    assert engine.zero_optimization_partition_gradients() == (zero["stage"] >= 2)
    assert engine.zero_optimization_partition_weights() == (zero["stage"] >= 3)
    assert engine.zero_cpu_offload() == engine.zero_use_cpu_optimizer() == (offload is not None)
    assert engine.cpuadam_cores_perc() == (offload["cpuadam_cores_perc"] if offload else 0.9)
    assert engine.zero_partial_offload() == 1.0 and engine.super_offload() is False
    assert engine.checkpoint_tag_validation_fail() == (cfg["checkpoint"]["tag_validation"] == "FAIL")
    want_comm = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
    assert engine.communication_data_type == want_comm
    assert engine.compile_zero_optimization_stage() is False and engine.uses_parallelization_pass_only() is False
    assert engine.checkpoint_writer_enabled() is False and engine.autotuning_profile_model_info() is False
