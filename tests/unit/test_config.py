"""DeepSpeedConfig: defaults, batch resolution, "auto", legacy forms, and a table of bad configs
that must each raise naming the offending key path."""
from __future__ import annotations

import base64
import json
import math
import warnings

import pytest
import torch

from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, DeepSpeedConfigWarning


def cfg(**kw):
    base = {"train_batch_size": 8}
    base.update(kw)
    return base


def test_defaults_follow_deepspeed():
    c = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2})
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (2, 2, 1)
    assert c.steps_per_print is None
    assert c.gradient_clipping == 1.0  # DeepSpeed >= 0.19.3 (was 0.0)
    assert c.prescale_gradients is False and c.gradient_predivide_factor == 1.0
    assert c.communication_data_type is None
    assert c.zero_optimization_stage == 0 and c.zero_enabled is False
    assert c.zero_config.reduce_bucket_size == 500_000_000 and c.zero_config.overlap_comm is False
    fp16 = c.float16_config
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
            fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == \
        (False, 0, 16, 1000, 2, False, 1, False)
    assert c.bfloat16_config.enabled is False and c.bfloat16_config.immediate_grad_update is False
    assert c.optimizer_name is None and c.scheduler_name is None
    assert c.zero_allow_untested_optimizer is False and c.zero_force_ds_cpu_optimizer is True
    assert c.wall_clock_breakdown is False and c.dataloader_drop_last is False
    assert c.checkpoint_tag_validation_enabled and not c.checkpoint_tag_validation_fail
    assert c.monitor_config.enabled is False
    assert c.comms_config.comms_logger.enabled is False


@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 12}, 3, (12, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 6}, 2, (12, 6, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2, (24, 3, 4)),
])
def test_batch_triple(given, world, expected):
    from deepspeed_c.runtime.config.batch import resolve_batch

    t = resolve_batch(given.get("train_batch_size"), given.get("train_micro_batch_size_per_gpu"),
                      given.get("gradient_accumulation_steps"), world)
    assert (t.train_batch_size, t.train_micro_batch_size_per_gpu, t.gradient_accumulation_steps) == expected
    assert t.train_batch_size == t.train_micro_batch_size_per_gpu * t.gradient_accumulation_steps * world


def test_auto_is_unset_with_warning():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        c = DeepSpeedConfig({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}},
                             "fp16": {"enabled": "auto"}, "zero_optimization": {"reduce_bucket_size": "auto"}})
    warned = " ".join(str(w.message) for w in record)
    for key in ("'train_micro_batch_size_per_gpu'", "'gradient_clipping'", "'optimizer.params.lr'", "'fp16.enabled'",
                "'zero_optimization.reduce_bucket_size'"):
        assert key in warned
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 1)
    assert c.gradient_clipping == 1.0  # DeepSpeed >= 0.19.3 (was 0.0)
    assert c.optimizer_params == {"weight_decay": 0.1}
    assert c.float16_config.enabled is False
    assert c.zero_config.reduce_bucket_size == 500_000_000


def test_steps_per_print_inf_and_raw_dict_kept():
    raw = cfg(steps_per_print=float("inf"), optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    c = DeepSpeedConfig(raw)
    assert c.steps_per_print == math.inf
    assert c._param_dict is raw and raw["optimizer"]["type"] == "Adam"
    assert c.optimizer_name == "adam"


def test_config_from_path_and_base64(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg(gradient_clipping=1.5)))
    assert DeepSpeedConfig(str(p)).gradient_clipping == 1.5
    encoded = base64.urlsafe_b64encode(json.dumps(cfg(gradient_clipping=2.5)).encode()).decode()
    assert DeepSpeedConfig(encoded).gradient_clipping == 2.5
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="Duplicate key 'train_batch_size'"):
        DeepSpeedConfig(str(dup))


def test_unknown_top_level_key_warns_with_closest():
    with pytest.warns(DeepSpeedConfigWarning, match="'gradient_clippin'.*'gradient_clipping'"):
        DeepSpeedConfig(cfg(gradient_clippin=1.0))


def test_eigenvalue_without_moq_warns_no_effect():
    # DeepSpeed reads the eigenvalue section only for MoQ (quantize_training); alone it changes nothing
    with pytest.warns(DeepSpeedConfigWarning, match=r"eigenvalue\.enabled.*no effect without.*quantize_training"):
        c = DeepSpeedConfig(cfg(eigenvalue={"enabled": True, "max_iter": 5}))
    assert c.eigenvalue_enabled and c.eigenvalue_config.max_iter == 5


def test_zero3_elastic_checkpoint_is_deprecated_when_the_section_is_built():
    from deepspeed_c.runtime.zero.config import DeepSpeedZeroConfig

    # DeepSpeed warns from the section's validator, at stage 3 only
    with pytest.warns(DeepSpeedConfigWarning, match="ZeRO-3 elastic checkpointing is deprecated"):
        DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
        DeepSpeedZeroConfig(stage=3)


def test_legacy_forms():
    with pytest.warns(DeepSpeedConfigWarning, match="deprecated"):
        c = DeepSpeedConfig(cfg(zero_optimization=False))
    assert c.zero_optimization_stage == 0
    with pytest.warns(DeepSpeedConfigWarning, match="cpu_offload"):  # moved; at stage 0 it has no effect
        c = DeepSpeedConfig(cfg(zero_optimization={"stage": 0, "cpu_offload": True}))
    assert c.zero_config.offload_optimizer.device == "cpu"
    c = DeepSpeedConfig(cfg(bfloat16={"enabled": True}))
    assert c.bfloat16_config.enabled and c.model_dtype() == torch.bfloat16
    c = DeepSpeedConfig(cfg(zero_optimization={"stage3_prefetch_bucket_size": 7, "stage": 0}))
    assert c.zero_config.prefetch_bucket_size == 7
    # the legacy 16-bit save flag also carries over when the section model is built directly
    from deepspeed_c.runtime.zero.config import DeepSpeedZeroConfig
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert not DeepSpeedZeroConfig(stage=3).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"
    assert DeepSpeedZeroConfig(cpu_offload_param=True).offload_param.device == "cpu"
    assert DeepSpeedZeroConfig(cpu_offload=False).offload_optimizer is None
    from deepspeed_c.runtime.zero.config import DeepSpeedZeroOffloadOptimizerConfig as OffOpt
    assert [OffOpt(pipeline_read=r, pipeline_write=w).pipeline for r, w in
            ((False, False), (True, False), (False, True))] == [False, True, True]


def test_fp16_scaler_knobs_checked_only_under_dynamic_scaling():
    # as DeepSpeed 0.19.8: a disabled section or a static scale may carry values the dynamic scaler would refuse,
    # and loss_scale takes what float() takes
    for fp16 in ({"enabled": False, "loss_scale_window": 0, "min_loss_scale": -1},
                 {"enabled": True, "loss_scale": "3", "loss_scale_window": 0, "min_loss_scale": 0}):
        c = DeepSpeedConfig(cfg(fp16=fp16))
        assert c.float16_config.loss_scale == float(fp16.get("loss_scale", 0))


def test_precision_keys_and_dtypes():
    c = DeepSpeedConfig(cfg(fp16={"enabled": True, "auto_cast": True, "loss_scale": 128},
                            communication_data_type="fp32", data_types={"grad_accum_dtype": "fp16"}))
    assert c.float16_config.auto_cast and c.float16_config.loss_scale == 128.0
    assert c.communication_data_type == torch.float32
    c = DeepSpeedConfig(cfg(bf16={"enabled": True, "immediate_grad_update": True}))
    assert c.bfloat16_config.immediate_grad_update
    c = DeepSpeedConfig(cfg(torch_autocast={"enabled": True, "dtype": "fp16"}))
    assert c.torch_autocast_enabled and c.torch_autocast_dtype == torch.float16


# (config, exception type, text that must appear: the key path)
BAD_CONFIGS = [
    (cfg(fp16={"enabled": "maybe"}), ValueError, "fp16.enabled"),
    (cfg(fp16={"enabled": True, "loss_scale": -1}), ValueError, "fp16.loss_scale"),
    (cfg(fp16={"enabled": True, "initial_scale_power": "big"}), ValueError, "fp16.initial_scale_power"),
    (cfg(fp16={"enabled": True, "loss_scale_window": 0}), ValueError, "fp16.loss_scale_window"),
    (cfg(fp16={"enabled": True, "min_loss_scale": 0}), ValueError, "fp16.min_loss_scale"),
    (cfg(fp16={"enabled": True, "loss_scale_window": True}), ValueError, "fp16.loss_scale_window"),
    (cfg(fp16={"enabled": False, "min_loss_scale": float("inf")}), ValueError, "fp16.min_loss_scale"),
    (cfg(fp16={"enabld": True}), ValueError, "fp16.enabld"),
    (cfg(fp16={"enabld": True}), ValueError, "Did you mean 'enabled'"),
    (cfg(bf16={"enabled": True, "imediate_grad_update": True}), ValueError, "bf16.imediate_grad_update"),
    (cfg(zero_optimization={"stage": 0, "reduce_bucket_sise": 10}), ValueError, "zero_optimization.reduce_bucket_sise"),
    (cfg(zero_optimization={"stage": 0, "offload_optimizer": {"devce": "cpu"}}), ValueError,
     "zero_optimization.offload_optimizer.devce"),
    (cfg(zero_optimization={"stage": 7}), ValueError, "zero_optimization.stage"),
    (cfg(zero_optimization={"stage": "two"}), ValueError, "zero_optimization.stage"),
    (cfg(zero_optimization={"reduce_bucket_size": -5}), ValueError, "zero_optimization.reduce_bucket_size"),
    (cfg(zero_optimization=[1]), ValueError, "zero_optimization"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, ValueError, "train_batch_size"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, ValueError,
     "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": 2}, ValueError, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": -8}, ValueError, "train_batch_size"),
    ({"train_batch_size": 8.5}, ValueError, "train_batch_size"),
    ({"train_batch_size": True}, ValueError, "train_batch_size"),
    (cfg(fp16={"enabled": True}, bf16={"enabled": True}), ValueError, "fp16.enabled"),
    (cfg(fp16={"enabled": True}, bf16={"enabled": True}), ValueError, "bf16.enabled"),
    (cfg(optimizer={"type": "Adamm"}), ValueError, "optimizer.type"),
    (cfg(optimizer={"type": "Adam", "parms": {}}), ValueError, "optimizer.parms"),
    (cfg(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}), ValueError, "optimizer.params.max_grad_norm"),
    (cfg(scheduler={"type": "WarmupLinear"}), ValueError, "scheduler.type"),
    (cfg(gradient_clipping="1.0"), ValueError, "gradient_clipping"),
    (cfg(gradient_clipping=-1.0), ValueError, "gradient_clipping"),
    (cfg(steps_per_print=0), ValueError, "steps_per_print"),
    (cfg(prescale_gradients="yes"), ValueError, "prescale_gradients"),
    (cfg(gradient_predivide_factor=0), ValueError, "gradient_predivide_factor"),
    (cfg(communication_data_type="int4"), ValueError, "communication_data_type"),
    (cfg(torch_autocast={"enabled": True, "dtype": "int8"}), ValueError, "torch_autocast.dtype"),
    (cfg(checkpoint={"tag_validation": "LOUD"}), ValueError, "checkpoint.tag_validation"),
    (cfg(comms_logger={"enabled": True, "verbos": True}), ValueError, "comms_logger.verbos"),
    (cfg(tensorboard={"enabled": True, "outpt_path": "x"}), ValueError, "tensorboard.outpt_path"),
    (cfg(activation_checkpointing={"partition_activation": True}), ValueError,
     "activation_checkpointing.partition_activation"),
    (cfg(data_types={"grad_accum_dtype": "fp64"}), ValueError, "data_types.grad_accum_dtype"),
    # capabilities not built yet
    (cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), ValueError,
     "zero_optimization.offload_param.nvme_path"),
    (cfg(pipeline={"stagez": 2}), ValueError, "pipeline.stagez"),
    (cfg(pipeline={"schedule": "gpipe"}), ValueError, "pipeline.schedule"),
    (cfg(aio={"block_sise": 1048576}), ValueError, "aio.block_sise"),
    (cfg(aio={"block_size": 1000}), ValueError, "aio.block_size"),
    (cfg(aio={"use_gds": True}), NotImplementedError, "aio.use_gds"),
    # AutoEP is built; these combinations are refused naming the key
    (cfg(expert_parallel={"enabled": True, "autoep_size": 2}, zero_optimization={"stage": 3}), ValueError,
     "expert_parallel.enabled"),
    (cfg(expert_parallel={"enabled": True, "autoep_size": 0}), ValueError, "expert_parallel.autoep_size"),
    (cfg(expert_parallel={"enabled": True, "top_k": 3}), NotImplementedError, "expert_parallel.top_k"),
    (cfg(expert_parallel={"enabled": True, "load_balance_coeff": 0.1}), ValueError,
     "expert_parallel.load_balance_coeff"),
    (cfg(expert_parallel={"enabled": True, "autoep_sise": 2}), ValueError, "expert_parallel.autoep_sise"),
    (cfg(amp={"enabled": True, "opt_level": "O1"}), NotImplementedError, "amp.enabled"),
    (cfg(sparse_gradients=True, zero_optimization={"stage": 2}), ValueError, "sparse_gradients"),  # stage 0 only
    (cfg(progressive_layer_drop={"enabled": True, "theta": "high"}), ValueError, "progressive_layer_drop.theta"),
    (cfg(curriculum_learning={"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
                              "schedule_type": "fixed_cubic"}), ValueError, "curriculum_learning.schedule_type"),
    (cfg(compile={"deepcompile": True}), ValueError, "compile.deepcompile"),  # ZeRO stage 0
    (cfg(compile={"deepcompile": True, "offload_opt_states": True}, zero_optimization={"stage": 3}),
     NotImplementedError, "compile.offload_opt_states"),
    (cfg(tensor_parallel={"autotp_size": 2}), ValueError, "tensor_parallel.autotp_size"),  # world of 1
    (cfg(sequence_parallel_size=0), ValueError, "sequence_parallel_size"),  # Ulysses is built: sizes >= 1
    (cfg(hybrid_engine={"enabled": True, "inference_tp_size": 2}), ValueError,
     "hybrid_engine.inference_tp_size"),  # world of 1
    (cfg(hybrid_engine={"enabled": True, "max_out_tokens": 0}), ValueError, "hybrid_engine"),
    (cfg(elasticity={"enabled": True}), NotImplementedError, "elasticity"),
    (cfg(autotuning={"enabled": True, "metric": "speed"}), ValueError, "autotuning.metric"),
    (cfg(autotuning={"tuner_typ": "random"}), ValueError, "autotuning.tuner_typ"),
]


@pytest.mark.parametrize("config, exc, path", BAD_CONFIGS, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_CONFIGS)])
def test_bad_config_raises_naming_the_key(config, exc, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        with pytest.raises(exc) as info:
            DeepSpeedConfig(config)
    assert path in str(info.value)
    if exc is ValueError:
        assert isinstance(info.value, DeepSpeedConfigError) or "validation" not in type(info.value).__name__.lower()


def test_invalid_value_message_names_value_and_allowed():
    with pytest.raises(ValueError) as info:
        DeepSpeedConfig(cfg(communication_data_type="int4"))
    msg = str(info.value)
    assert "'int4'" in msg and "bf16" in msg and "fp32" in msg
    with pytest.raises(ValueError) as info:
        DeepSpeedConfig(cfg(zero_optimization={"stage": 7}))
    assert "7" in str(info.value) and "3" in str(info.value)


def test_disabled_unbuilt_sections_are_accepted():
    c = DeepSpeedConfig(cfg(flops_profiler={"enabled": False, "profile_step": 3}, elasticity={"enabled": False},
                            amp={"enabled": False}, compile={"deepcompile": False},
                            zero_optimization={"stage": 0, "offload_optimizer": {"device": "none"}}))
    assert c.flops_profiler_config.profile_step == 3


def test_config_model_base_migrates_deprecated_fields_and_drops_auto():
    from typing import Optional

    from pydantic import Field

    from deepspeed_c.runtime.config_utils import DeepSpeedConfigModel

    class Inner(DeepSpeedConfigModel):
        depth: int = 1

    class Section(DeepSpeedConfigModel):
        inner: Inner = Field(default_factory=Inner)
        width: Optional[int] = None
        old_width: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "width",
                                                                  "new_param_fn": int})
        old_depth: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "inner.depth"})
        note_only: int = Field(0, json_schema_extra={"deprecated": True})

    assert Section(old_width="12").width == 12
    assert Section(old_depth=5).inner.depth == 5
    assert Section(note_only=3).width is None and Section(width=4).width == 4
    with pytest.raises(AssertionError, match="old_width"):
        Section(old_width="1", width=2)
    assert Section(width="auto").width is None  # "auto" takes the default unless strict
    with pytest.raises(Exception):
        Section(strict=True, width="auto")
