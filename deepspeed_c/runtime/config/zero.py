"""The typed `zero_optimization` section (DeepSpeedZeroConfig with its offload sub-sections),
DeepSpeed 0.19's keys, aliases, defaults and legacy forms.

Which stages run is decided here in one place: SUPPORTED_ZERO_STAGES. The ZeRO issues add their
stage when its optimizer lands; until then a config asking for it raises NotImplementedError
naming `zero_optimization.stage`."""
from __future__ import annotations

import os
import sys
from enum import Enum
from typing import Annotated, Any, Optional

from pydantic import BeforeValidator, Field, model_validator

from deepspeed_c.runtime.config.utils import (DeepSpeedConfigError, DeepSpeedConfigModel, config_warning,
                                              parse_section, unbuilt)
from deepspeed_c.runtime.config.zenflow import ZenFlowConfig

ZERO_OPTIMIZATION = "zero_optimization"
SUPPORTED_ZERO_STAGES: set[int] = {0, 1, 2, 3}


class ZeroStageEnum(int, Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# DeepSpeed types nvme_path as a pathlib.Path: a path object is taken, and kept as its string here
NvmePath = Annotated[Optional[str], BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v)]


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    nvme_path: NvmePath = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(int(1e8), ge=0)
    max_in_cpu: int = Field(int(1e9), ge=0)
    pin_memory: bool = True  # DeepSpeed 0.19.8 pins by default


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    nvme_path: NvmePath = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True  # DeepSpeed 0.19.8 pins by default
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        """Whether tile reads or writes overlap the optimizer step (DeepSpeed's derived flag)."""
        return bool(self.pipeline_read or self.pipeline_write)


# DeepSpeed 0.19.8 gathers these Hugging Face MoE blocks whole by default: their experts run data-dependently,
# so a rank may skip an expert another rank runs and per-expert gathers would not match across ranks
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @model_validator(mode="before")
    @classmethod
    def _one_string_is_a_list(cls, values: Any) -> Any:
        if values is None:
            return {}
        if not isinstance(values, dict):
            raise TypeError("zero_optimization.leaf_module must be a mapping of classes / names / name_suffixes")
        return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                for k, v in values.items()}

    @model_validator(mode="after")
    def _dedupe(self) -> "DeepSpeedZeroLeafModuleConfig":
        for key in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, key, list(dict.fromkeys(getattr(self, key))))
        return self


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(int(5e8), ge=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(int(5e8), ge=0)
    overlap_comm: Optional[bool] = None  # None: True for stage 3, else False
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    zenflow: Optional[ZenFlowConfig] = None
    sub_group_size: int = Field(int(1e9), ge=0)
    # legacy: offload_param.device = cpu. The parser (_apply_legacy_keys) moves it with a config error on
    # conflicts; a directly built model moves it through the base's deprecated-field migration
    cpu_offload_param: Optional[bool] = Field(None, json_schema_extra={
        "deprecated": True, "new_param": "offload_param",
        "new_param_fn": lambda on: DeepSpeedZeroOffloadParamConfig(device="cpu") if on else None})
    cpu_offload_use_pin_memory: Optional[bool] = None  # legacy: pin_memory of both offload sections
    cpu_offload: Optional[bool] = Field(None, json_schema_extra={  # legacy: offload_optimizer.device = cpu
        "deprecated": True, "new_param": "offload_optimizer",
        "new_param_fn": lambda on: DeepSpeedZeroOffloadOptimizerConfig(device="cpu") if on else None})
    prefetch_bucket_size: int = Field(int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(int(1e9), ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(int(1e9), ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = False  # legacy name of the 16-bit save flag
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: Optional[dict[str, Any]] = None
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)

    @model_validator(mode="after")
    def _dynamic_defaults(self) -> "DeepSpeedZeroConfig":
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == ZeroStageEnum.weights)
        # the legacy save flag carries over when the model is built directly too (DeepSpeedZeroConfig(**d)),
        # not only through the config parser, as DeepSpeed's deprecated-field migration does
        if self.stage3_gather_fp16_weights_on_model_save:
            object.__setattr__(self, "gather_16bit_weights_on_model_save", True)
        if self.stage == ZeroStageEnum.weights and self.elastic_checkpoint:
            # DeepSpeed warns when the section is built, at stage 3 only (below it initialize names the key as
            # having no effect, runtime/config/no_effect.py)
            config_warning(f"Config key '{ZERO_OPTIMIZATION}.elastic_checkpoint': ZeRO-3 elastic checkpointing is "
                           "deprecated; ZeRO-3 checkpoints reshard on load without it, and universal checkpoints "
                           "(checkpoint.load_universal) carry them across parallel layouts")
        return self


def _legacy_bool_form(param_dict: dict[str, Any], value: bool) -> dict[str, Any]:
    config_warning("DeepSpeedConfig: \"zero_optimization\": true/false is a deprecated format; use "
                   "\"zero_optimization\": {\"stage\": N}")
    out: dict[str, Any] = {"stage": 1 if value else 0}
    if value and "allgather_size" in param_dict:
        out["allgather_bucket_size"] = int(param_dict["allgather_size"])
    return out


def _apply_legacy_keys(cfg: DeepSpeedZeroConfig) -> None:
    path = ZERO_OPTIMIZATION
    for legacy, key, sub_config in (("cpu_offload", "offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
                                    ("cpu_offload_param", "offload_param", DeepSpeedZeroOffloadParamConfig)):
        value = getattr(cfg, legacy)
        if value is None:
            continue
        config_warning(f"Config key '{path}.{legacy}' is deprecated; use '{path}.{key}'")
        if value:
            setattr(cfg, key, sub_config(device="cpu"))
    if cfg.cpu_offload_use_pin_memory is not None:
        config_warning(f"Config key '{path}.cpu_offload_use_pin_memory' is deprecated; use "
                       f"'{path}.offload_param.pin_memory' or '{path}.offload_optimizer.pin_memory'")
        for sub in (cfg.offload_optimizer, cfg.offload_param):  # DeepSpeed applies it to both
            if sub is not None:
                sub.pin_memory = bool(cfg.cpu_offload_use_pin_memory)
    if cfg.stage3_gather_fp16_weights_on_model_save:
        config_warning(f"Config key '{path}.stage3_gather_fp16_weights_on_model_save' is deprecated; use "
                       f"'{path}.gather_16bit_weights_on_model_save'")
        cfg.gather_16bit_weights_on_model_save = True


def _check_built(cfg: DeepSpeedZeroConfig) -> None:
    path = ZERO_OPTIMIZATION
    if cfg.stage not in SUPPORTED_ZERO_STAGES:
        raise unbuilt(f"{path}.stage", f"ZeRO stage {cfg.stage}")
    for key, what in (("offload_param", "parameter offload"), ("offload_optimizer", "optimizer offload")):
        sub = getattr(cfg, key)
        if key == "offload_optimizer" and cfg.stage in (1, 2, 3) and sub is not None and \
                sub.device in (OffloadDeviceEnum.cpu.value, OffloadDeviceEnum.nvme.value):
            continue  # ZeRO-Offload of the optimizer to the host (or ZeRO-Infinity's to NVMe): stages 1, 2, 3
        if key == "offload_param" and cfg.stage == 3 and sub is not None and \
                sub.device in (OffloadDeviceEnum.cpu.value, OffloadDeviceEnum.nvme.value):
            continue  # ZeRO-3 keeps the parameter shards in host memory (or in swap files on NVMe)
        unused_at = (0, 1, 2) if key == "offload_param" else (0,)
        if cfg.stage in unused_at and sub is not None and \
                sub.device in (OffloadDeviceEnum.cpu.value, OffloadDeviceEnum.nvme.value):
            # DeepSpeed reads offload_param at stage 3 only (offload_optimizer at stages 1-3) and trains the other
            # stages with everything on the device; configs shared across stages (Lightning's offload_parameters,
            # accelerate's plugin) rely on that, so the key is ignored here too, said once
            config_warning(f"Config key '{path}.{key}' (device '{sub.device}') has no effect at ZeRO stage "
                           f"{cfg.stage}: {what} runs at stage{' 3' if key == 'offload_param' else 's 1-3'} only "
                           "(as in DeepSpeed)")
            continue
        if sub is not None and sub.device != OffloadDeviceEnum.none.value:
            device_what = "NVMe offload" if sub.device == OffloadDeviceEnum.nvme.value else what
            raise unbuilt(f"{path}.{key}.device", f"{device_what} to '{sub.device}'")
    if cfg.stage == 3 and cfg.offload_param is not None and cfg.offload_param.device == OffloadDeviceEnum.nvme.value \
            and not cfg.offload_param.nvme_path:
        raise DeepSpeedConfigError(f"Config key '{path}.offload_param.nvme_path' must name a directory when "
                                   f"'{path}.offload_param.device' is 'nvme'")
    if cfg.stage > 0 and cfg.offload_optimizer is not None and \
            cfg.offload_optimizer.device == OffloadDeviceEnum.nvme.value and not cfg.offload_optimizer.nvme_path:
        raise DeepSpeedConfigError(f"Config key '{path}.offload_optimizer.nvme_path' must name a directory when "
                                   f"'{path}.offload_optimizer.device' is 'nvme'")
    if cfg.offload_optimizer is not None and cfg.offload_optimizer.device == OffloadDeviceEnum.nvme.value and \
            cfg.offload_optimizer.ratio < 1.0:
        raise unbuilt(f"{path}.offload_optimizer.ratio", "partial optimizer offload (ratio < 1)")
    if cfg.offload_optimizer is not None and cfg.offload_optimizer.device == OffloadDeviceEnum.cpu.value and \
            cfg.offload_optimizer.ratio < 1.0 and not (cfg.offload_optimizer.super_offload and cfg.stage == 3):
        raise unbuilt(f"{path}.offload_optimizer.ratio", "partial optimizer offload (ratio < 1) without "
                                                         "offload_optimizer.super_offload at stage 3")
    below3 = cfg.stage != ZeroStageEnum.weights  # ZeRO++ (runtime/zero/zeropp.py) runs on stage 3
    _check_fast_offload(cfg)
    _check_mics(cfg)
    if below3:
        # DeepSpeed's stage 1/2 optimizer never reads the ZeRO++ keys (they belong to stage 3's partitioner); a
        # config shared across stages trains there without them, so here too, said once
        on = [k for k, v in (("zero_quantized_weights", cfg.zero_quantized_weights),
                             ("zero_quantized_nontrainable_weights", cfg.zero_quantized_nontrainable_weights),
                             ("zero_quantized_gradients", cfg.zero_quantized_gradients),
                             ("zero_hpz_partition_size", cfg.zero_hpz_partition_size > 1),
                             ("zeropp_loco_param", cfg.zeropp_loco_param is not None)) if v]
        if on:
            config_warning(f"Config key(s) {', '.join(f'{path}.{k}' for k in on)} (ZeRO++) have no effect at ZeRO "
                           f"stage {cfg.stage}: ZeRO++ runs at stage 3 only (as in DeepSpeed)")
        return
    if cfg.zero_quantized_gradients and not cfg.reduce_scatter:
        raise unbuilt(f"{path}.zero_quantized_gradients",
                      "ZeRO++ quantized gradients with reduce_scatter false (qgZ replaces the reduce-scatter)")
    if cfg.zeropp_loco_param is not None and not cfg.zero_quantized_gradients:
        raise ValueError(f"{path}.zeropp_loco_param: LoCo is error feedback for qgZ's quantized gradients; it needs "
                         f"{path}.zero_quantized_gradients true at stage 3")
    if cfg.zeropp_loco_param is not None:
        from deepspeed_c.runtime.zero.loco import LocoErrorFeedback

        LocoErrorFeedback.from_config(cfg.zeropp_loco_param, 1)  # its values checked now, naming the key


def _check_mics(cfg: DeepSpeedZeroConfig) -> None:
    """MiCS (runtime/zero/mics.py) shards ZeRO stage 3; the shard size dividing the world is checked when the
    engine builds its groups (mics_utils.check_shard_size)."""
    path = ZERO_OPTIMIZATION
    if cfg.mics_shard_size <= 0:
        return
    if cfg.stage != ZeroStageEnum.weights:
        raise ValueError(f"{path}.mics_shard_size={cfg.mics_shard_size}: MiCS shards ZeRO stage 3's parameters, "
                         f"gradients and optimizer states over groups of that many ranks; {path}.stage is "
                         f"{int(cfg.stage)}: set it to 3, or remove mics_shard_size")
    off = cfg.offload_optimizer
    if off is not None and off.device != OffloadDeviceEnum.none.value:
        raise unbuilt(f"{path}.offload_optimizer", "optimizer offload with MiCS (mics_shard_size; DeepSpeed's MiCS "
                                                   "refuses it too: 'Local sharding has no support for CPU offloading')")
    par = cfg.offload_param
    if par is not None and par.device == OffloadDeviceEnum.nvme.value:
        raise unbuilt(f"{path}.offload_param.device", "NVMe parameter offload with MiCS (mics_shard_size)")
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if getattr(cfg, key):
            raise unbuilt(f"{path}.{key}", "ZeRO++ together with MiCS (mics_shard_size)")
    if cfg.zero_hpz_partition_size > 1:
        raise unbuilt(f"{path}.zero_hpz_partition_size", "ZeRO++ hpZ together with MiCS (mics_shard_size)")
    if cfg.zenflow is not None:
        raise unbuilt(f"{path}.zenflow", "ZenFlow together with MiCS (mics_shard_size)")


def _check_fast_offload(cfg: DeepSpeedZeroConfig) -> None:
    """ZenFlow and SuperOffload sit on ZeRO-Offload of the optimizer to the host (DeepSpeed checks these when it
    builds the optimizer; here they fail at parse time, naming the keys)."""
    path = ZERO_OPTIMIZATION
    off = cfg.offload_optimizer
    on_cpu = off is not None and off.device == OffloadDeviceEnum.cpu.value
    if cfg.zenflow is not None:
        if not on_cpu:
            raise DeepSpeedConfigError(f"Zenflow must be used with cpu offload: '{path}.zenflow' needs "
                                       f"'{path}.offload_optimizer.device' = 'cpu'")
        if cfg.stage not in (1, 2, 3):
            raise unbuilt(f"{path}.zenflow", f"ZenFlow at ZeRO stage {cfg.stage} (DeepSpeed and deepspeed_c run it at "
                                             f"stages 1, 2 and 3)")
        if cfg.zenflow.select_strategy == "auto" and not isinstance(cfg.zenflow.select_interval, str):
            # DeepSpeed's model parses it and its engine refuses it; a whole config fails here already
            raise DeepSpeedConfigError(f"'{path}.zenflow.select_interval' is {cfg.zenflow.select_interval!r} with "
                                       "select_strategy \"auto\", which selects every epoch, so select_interval would "
                                       "be overwritten: set select_strategy to \"step\" or \"epoch\", or select_interval "
                                       "to \"auto\"")
        if cfg.zenflow.offload:
            raise unbuilt(f"{path}.zenflow.offload", "ZenFlow's selected-column moments kept in host memory")
        if off is not None and off.super_offload:
            raise DeepSpeedConfigError(f"Config keys '{path}.zenflow' and '{path}.offload_optimizer.super_offload' "
                                       f"cannot be used together (two different offload steps)")
    if off is not None and off.super_offload:
        if cfg.stage != ZeroStageEnum.weights:
            raise DeepSpeedConfigError(f"Config key '{path}.offload_optimizer.super_offload' needs ZeRO stage 3 "
                                       f"('{path}.stage' is {cfg.stage}); SuperOffload is a ZeRO-3 optimizer")
        if not on_cpu:
            raise DeepSpeedConfigError(f"Config key '{path}.offload_optimizer.super_offload' needs "
                                       f"'{path}.offload_optimizer.device' = 'cpu' (got '{off.device}')")


def parse_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    raw = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(raw, bool):
        raw = _legacy_bool_form(param_dict, raw)
    if isinstance(raw, dict):  # checked on the raw keys: the model's own migration has moved them once built
        for legacy, key in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if raw.get(legacy) is not None and raw.get(key) is not None:
                raise DeepSpeedConfigError(f"Config keys '{ZERO_OPTIMIZATION}.{legacy}' and "
                                           f"'{ZERO_OPTIMIZATION}.{key}' cannot be given together")
    cfg = parse_section(DeepSpeedZeroConfig, raw, ZERO_OPTIMIZATION)
    _apply_legacy_keys(cfg)
    _check_built(cfg)
    return cfg


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """DeepSpeed's name for the section parser."""
    return parse_zero_config(param_dict)
