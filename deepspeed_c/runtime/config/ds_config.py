"""DeepSpeedConfig: the DeepSpeed JSON config parsed once into typed sections.

Nothing downstream reads the raw dict; `_param_dict` is kept, as given, only so that
`engine.config` returns what the user passed (Hugging Face reads it)."""
from __future__ import annotations

import base64
import binascii
import json
import math
import os
from typing import Any, Optional, Union

import torch

from deepspeed_c.runtime.config.batch import (GRADIENT_ACCUMULATION_STEPS, TRAIN_BATCH_SIZE,
                                              TRAIN_MICRO_BATCH_SIZE_PER_GPU, resolve_batch)
from deepspeed_c.runtime.config.optim import (ADAM_W_MODE, ADAM_W_MODE_DEFAULT, DEEPSPEED_OPTIMIZERS,
                                              LAMB_OPTIMIZER, TORCH_ADAM_PARAM, parse_optimizer, parse_scheduler)
from deepspeed_c.runtime.config.precision import parse_precision
from deepspeed_c.runtime.config.sections import ValidationMode, parse_misc_sections
from deepspeed_c.runtime.config.utils import (DeepSpeedConfigError, DeepSpeedConfigModel, DeepSpeedConfigWarning,
                                              closest, config_warning, parse_dtype, parse_section, scalar,
                                              strip_auto)
from deepspeed_c.runtime.config.zero import ZeroStageEnum, parse_zero_config
from deepspeed_c.utils.logging import logger
from deepspeed_c.version import DEEPSPEED_API_VERSION

__all__ = [
    "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigModel", "DeepSpeedConfigWarning",
    "ZeroStageEnum", "DEEPSPEED_OPTIMIZERS", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT", "TORCH_ADAM_PARAM", "LAMB_OPTIMIZER",
]

# Every top-level key DeepSpeed 0.19 reads; anything else draws a warning naming the closest one.
KNOWN_TOP_LEVEL_KEYS = frozenset({
    TRAIN_BATCH_SIZE, TRAIN_MICRO_BATCH_SIZE_PER_GPU, GRADIENT_ACCUMULATION_STEPS, "steps_per_print",
    "dump_state", "disable_allgather", "communication_data_type", "seq_parallel_communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16",
    "bfloat16", "amp", "torch_autocast", "compression_training", "graph_harvesting", "optimizer", "scheduler",
    "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "autotuning", "eigenvalue",
    "quantize_training", "use_data_before_expert_parallelism", "hybrid_engine", "sparse_attention", "pipeline",
    "progressive_layer_drop", "curriculum_learning", "data_efficiency", "checkpoint", "data_types", "aio",
    "dataloader_drop_last", "nebula", "weight_quantization", "compile", "timers", "tensor_parallel",
    "expert_parallel", "elasticity", "vocabulary_size", "sequence_parallel_size", "data_parallel_size",
    "allgather_size", "datastates_ckpt", "trackio", "gradient_allreduce_op",
})

_MONITOR_SECTIONS = (("tensorboard", "TensorBoardConfig"), ("wandb", "WandbConfig"),
                     ("csv_monitor", "CSVConfig"), ("comet", "CometConfig"), ("trackio", "TrackioConfig"))


_NOTED_DEFAULTS: set[str] = set()


def _global_rank() -> int:
    """This process's rank in the job: the process group's when there is one, else the launcher's RANK."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def note_changed_default(key: str, old: str, new: str) -> None:
    """Once per job: a config relies on a default that changed between DeepSpeed releases. Every rank
    parses the same config, so rank 0 speaks for all (N copies of one note bury the other output)."""
    if key in _NOTED_DEFAULTS or _global_rank() != 0:
        return
    _NOTED_DEFAULTS.add(key)
    from deepspeed_c.utils.logging import logger

    logger.warning(f"Config key '{key}' is not set: using the default of DeepSpeed {DEEPSPEED_API_VERSION}, {new} "
                   f"(it was {old}); set '{key}' explicitly to silence this note")


def _load(config: Union[str, dict, os.PathLike]) -> dict:
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"Expected a DeepSpeed config dict, a path to a JSON file, or base64 JSON; "
                         f"got {type(config).__name__}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                raise DeepSpeedConfigError(f"Duplicate key '{k}' in the DeepSpeed config")
            out[k] = v
        return out

    # DeepSpeed reads config files and base64 configs with hjson (a superset of JSON: comments,
    # unquoted keys, trailing commas); the dicts it returns are plain dicts
    import hjson

    path = os.fspath(config)
    if os.path.exists(path):
        with open(path, "r", encoding="utf-8") as f:
            try:
                loaded = hjson.load(f, object_pairs_hook=no_duplicates)
            except hjson.HjsonDecodeError as e:
                raise DeepSpeedConfigError(f"DeepSpeed config file {path} is neither JSON nor HJSON: {e}") from None
    else:
        try:
            loaded = hjson.loads(base64.urlsafe_b64decode(path).decode("utf-8"), object_pairs_hook=no_duplicates)
        except (binascii.Error, UnicodeDecodeError, ValueError, hjson.HjsonDecodeError):
            raise ValueError(f"Expected a string path to an existing deepspeed config, or a dictionary or a valid "
                             f"base64. Received: {path}") from None
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"A DeepSpeed config must be a JSON object, got {type(loaded).__name__}")
    return loaded


def _dp_world(mpu: Any, mesh_device: Any, sequence_parallel_size: Any = None) -> tuple[int, int]:
    """(global rank, data-parallel world size); a world of one when no process group is up. Without an mpu
    or mesh, the config's sequence_parallel_size divides the world (DeepSpeed's HF zero.Init case)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank = dist.get_rank()
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return rank, int(mpu.get_data_parallel_world_size())
        return rank, dist.get_world_size() // int(mpu.get_sequence_parallel_world_size())
    if mesh_device is not None:
        return rank, dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    if isinstance(sequence_parallel_size, int) and sequence_parallel_size > 1:
        if dist.get_world_size() % sequence_parallel_size != 0:
            raise ValueError(f"sequence_parallel_size={sequence_parallel_size} does not divide the world size "
                             f"{dist.get_world_size()}")
        return rank, dist.get_world_size() // sequence_parallel_size
    return rank, dist.get_world_size()


def _gradient_allreduce_op(pd: dict) -> str:
    """DeepSpeed >= 0.19.6: "mean" averages gradients over the data-parallel ranks, "sum" adds them.
    Its messages are kept word for word up to the key names: callers match on them."""
    op = pd.get("gradient_allreduce_op", "mean")
    if isinstance(op, str):
        op = op.lower()
    if op not in ("mean", "sum"):
        raise DeepSpeedConfigError(f"Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']. Got: {op!r} "
                                   "(config key 'gradient_allreduce_op')")
    if op == "sum":
        zero = pd.get("zero_optimization")
        if isinstance(zero, dict) and zero.get("zenflow") is not None:
            raise DeepSpeedConfigError("gradient_allreduce_op='sum' is not supported with ZenFlow (config keys "
                                       "'gradient_allreduce_op' and 'zero_optimization.zenflow')")
        compile_cfg = pd.get("compile")
        if isinstance(compile_cfg, dict) and compile_cfg.get("deepcompile") is True:
            raise DeepSpeedConfigError("gradient_allreduce_op='sum' is not supported with DeepCompile (config keys "
                                       "'gradient_allreduce_op' and 'compile.deepcompile')")
    return op


class DeepSpeedConfig:
    """DeepSpeedConfig(config: str | dict, mpu=None, mesh_device=None)."""

    def __init__(self, config: Union[str, dict], mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict = _load(config)
        self.global_rank, self.world_size = _dp_world(mpu, mesh_device,
                                                      self._param_dict.get("sequence_parallel_size"))
        self.elasticity_enabled = False
        param_dict = dict(self._param_dict)
        self._warn_unknown_top_level(param_dict)
        self._initialize_params(param_dict)
        self._configure_train_batch_size(param_dict)

    # -- parsing ---------------------------------------------------------------------------------
    @staticmethod
    def _warn_unknown_top_level(param_dict: dict) -> None:
        for key in param_dict:
            if key not in KNOWN_TOP_LEVEL_KEYS:
                near = closest(key, KNOWN_TOP_LEVEL_KEYS)
                hint = f" (did you mean '{near}'?)" if near else ""
                config_warning(f"Unknown top-level DeepSpeed config key '{key}' is ignored{hint}")

    def _initialize_params(self, raw: dict) -> None:
        pd = strip_auto({k: v for k, v in raw.items() if not isinstance(v, dict)}, "")
        pd.update({k: v for k, v in raw.items() if isinstance(v, dict)})

        self._raw_batch = (pd.get(TRAIN_BATCH_SIZE), pd.get(TRAIN_MICRO_BATCH_SIZE_PER_GPU),
                           pd.get(GRADIENT_ACCUMULATION_STEPS))
        self.steps_per_print = scalar(pd, "steps_per_print", (int, float), None, allow_none=True,
                                      check=lambda v: (isinstance(v, int) and v > 0) or v == math.inf,
                                      allowed="an int > 0 or float('inf')")
        self.dump_state = scalar(pd, "dump_state", bool, False)
        self.disable_allgather = scalar(pd, "disable_allgather", bool, False)
        self.communication_data_type = parse_dtype(pd.get("communication_data_type"), "communication_data_type")
        self.seq_parallel_communication_data_type = parse_dtype(
            pd.get("seq_parallel_communication_data_type", "fp32"), "seq_parallel_communication_data_type")
        self.prescale_gradients = scalar(pd, "prescale_gradients", bool, False)
        self.gradient_predivide_factor = float(scalar(pd, "gradient_predivide_factor", (int, float), 1.0,
                                                      check=lambda v: v > 0, allowed="a number > 0"))
        self.sparse_gradients_enabled = scalar(pd, "sparse_gradients", bool, False)
        # DeepSpeed >= 0.19.6: "mean" averages gradients over the data-parallel ranks, "sum" adds them
        self.gradient_allreduce_op = _gradient_allreduce_op(pd)
        # DeepSpeed 0.19.3 changed this default from 0.0 (no clipping) to 1.0
        self.gradient_clipping = float(scalar(pd, "gradient_clipping", (int, float), 1.0,
                                              check=lambda v: v >= 0 and math.isfinite(v), allowed="a number >= 0"))
        if "gradient_clipping" not in pd:
            note_changed_default("gradient_clipping", old="0.0 (no clipping) before DeepSpeed 0.19.3",
                                 new="1.0 since DeepSpeed 0.19.3")
        self.graph_harvesting = scalar(pd, "graph_harvesting", bool, False)
        # DeepSpeed reads this one without a type check: any truthy value (1, "yes") allows
        self.zero_allow_untested_optimizer = bool(pd.get("zero_allow_untested_optimizer", False))
        self.zero_force_ds_cpu_optimizer = scalar(pd, "zero_force_ds_cpu_optimizer", bool, True)
        self.wall_clock_breakdown = scalar(pd, "wall_clock_breakdown", bool, False)
        self.memory_breakdown = scalar(pd, "memory_breakdown", bool, False)
        self.dataloader_drop_last = scalar(pd, "dataloader_drop_last", bool, False)
        self.use_data_before_expert_parallel_ = scalar(pd, "use_data_before_expert_parallelism", bool, False)
        self.vocabulary_size = scalar(pd, "vocabulary_size", int, None, allow_none=True)
        self.sequence_parallel_size = scalar(pd, "sequence_parallel_size", int, 1, check=lambda v: v >= 1)

        self.zero_config = parse_zero_config(pd)
        self.zero_optimization_stage = int(self.zero_config.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        if self.gradient_allreduce_op == "sum" and self.zero_optimization_stage == 3:
            # DeepSpeed's stage 3 always averages its reduce-scattered gradients
            raise DeepSpeedConfigError("gradient_allreduce_op='sum' is not supported with ZeRO stage 3 (config keys "
                                       "'gradient_allreduce_op' and 'zero_optimization.stage'); use 'mean'")
        self.mics_shard_size = self.zero_config.mics_shard_size
        self.mics_hierarchial_params_gather = self.zero_config.mics_hierarchical_params_gather
        # imported here: aio_config builds on runtime.config.utils, whose package imports this module
        from deepspeed_c.runtime.swap_tensor.aio_config import get_aio_config

        self.aio_config = get_aio_config(pd)  # DeepNVMe handle settings for NVMe offload

        precision = parse_precision(pd, zero_stage=self.zero_optimization_stage)
        self.float16_config = precision["float16_config"]
        self.bfloat16_config = precision["bfloat16_config"]
        self.torch_autocast_config = precision["torch_autocast_config"]
        self.torch_autocast_enabled = self.torch_autocast_config.enabled
        self.torch_autocast_dtype = self.torch_autocast_config.dtype
        self.torch_autocast_lower_precision_safe_modules = self.torch_autocast_config.lower_precision_safe_modules
        self.data_types_config = precision["data_types_config"]
        self.grad_accum_dtype = self.data_types_config.grad_accum_dtype
        self.param_dtype = self.data_types_config.param_dtype
        self.buffer_dtype = self.data_types_config.buffer_dtype
        self.amp_enabled = precision["amp_enabled"]
        self.amp_params = precision["amp_params"]

        optimizer = parse_optimizer(pd)
        self.optimizer_config = optimizer
        self.optimizer_name = optimizer.type
        self.optimizer_params = optimizer.params
        self.optimizer_legacy_fusion = optimizer.legacy_fusion
        scheduler = parse_scheduler(pd)
        self.scheduler_config = scheduler
        self.scheduler_name = scheduler.type
        self.scheduler_params = scheduler.params
        if self.optimizer_name == LAMB_OPTIMIZER and self.float16_config.enabled \
                and self.float16_config.loss_scale != 0:
            raise DeepSpeedConfigError("Config key 'fp16.loss_scale' must be 0 (dynamic) with the Lamb optimizer: "
                                       "DeepSpeed Lamb requires dynamic loss scaling")

        misc = parse_misc_sections(pd)
        for name, value in misc.items():
            setattr(self, name, value)
        from deepspeed_c.runtime.config.expert_parallel import parse_expert_parallel

        self.expert_parallel_config = parse_expert_parallel(pd, self.zero_optimization_stage,
                                                            self.tensor_parallel_config.autotp_size)
        from deepspeed_c.runtime.config.hybrid_engine import parse_hybrid_engine

        self.hybrid_engine = parse_hybrid_engine(pd)
        self.wall_clock_breakdown = self.wall_clock_breakdown or self.flops_profiler_config.enabled
        self.eigenvalue_enabled = self.eigenvalue_config.enabled
        self.pld_enabled = self.pld_config.enabled
        self.pld_params = self.pld_config.model_dump() if self.pld_enabled else False
        ckpt = self.checkpoint_config
        self.checkpoint_tag_validation_enabled = ckpt.tag_validation != ValidationMode.IGNORE.value
        self.checkpoint_tag_validation_fail = ckpt.tag_validation == ValidationMode.FAIL.value
        self.load_universal_checkpoint = ckpt.load_universal
        self.use_node_local_storage = ckpt.use_node_local_storage
        self.checkpoint_parallel_write_pipeline = ckpt.parallel_write.pipeline_stage

        self.comms_config = self._parse_comms(pd)
        self.monitor_config = self._parse_monitor(pd)

    @staticmethod
    def _parse_comms(pd: dict) -> Any:
        from deepspeed_c.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig

        logger_cfg = parse_section(CommsLoggerConfig, pd.get("comms_logger"), "comms_logger")
        comms = DeepSpeedCommsConfig({})
        comms.comms_logger_enabled = "comms_logger" in pd
        comms.comms_logger = logger_cfg
        return comms

    @staticmethod
    def _parse_monitor(pd: dict) -> Any:
        try:
            from deepspeed_c.monitor import config as monitor_config
        except ImportError:
            monitor_config = None
        sections: dict[str, Any] = {}
        for key, cls_name in _MONITOR_SECTIONS:
            cls = getattr(monitor_config, cls_name, None) if monitor_config is not None else None
            if cls is None:
                # the monitor package is not there yet: keep the section as given
                sections[key] = pd.get(key, {})
            else:
                sections[key] = parse_section(cls, pd.get(key), key)
        builder = getattr(monitor_config, "DeepSpeedMonitorConfig", None) if monitor_config is not None else None
        if builder is not None and all(not isinstance(v, dict) for v in sections.values()):
            return builder(**sections)
        return _RawMonitorConfig(sections)

    def _configure_train_batch_size(self, pd: dict) -> None:
        triple = resolve_batch(*self._raw_batch, self.world_size)
        self.train_batch_size = triple.train_batch_size
        self.train_micro_batch_size_per_gpu = triple.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = triple.gradient_accumulation_steps

    # -- the only changes after construction: DeepSpeed's engine setters ------------------------
    def set_batch_sizes(self, train_batch_size: int, *, train_micro_batch_size_per_gpu: Optional[int] = None,
                        gradient_accumulation_steps: Optional[int] = None) -> None:
        """engine.set_train_batch_size / set_train_micro_batch_size: the new batch sizes (the engine checked
        that they agree with the data-parallel size); an omitted one keeps its value."""
        self.train_batch_size = train_batch_size
        if train_micro_batch_size_per_gpu is not None:
            self.train_micro_batch_size_per_gpu = train_micro_batch_size_per_gpu
        if gradient_accumulation_steps is not None:
            self.gradient_accumulation_steps = gradient_accumulation_steps

    def set_communication_data_type(self, value: Optional[torch.dtype]) -> None:
        """engine.communication_data_type = dtype (DeepSpeed's engine lets a client change the wire dtype)."""
        self.communication_data_type = value

    def set_gradient_clipping(self, value: float) -> None:
        """The pipeline engine builds its optimizers without clipping (it clips with the pipeline-wide norm
        itself) and puts the configured value back afterwards."""
        self.gradient_clipping = float(value)

    # -- conveniences the engine and tests read -------------------------------------------------
    @property
    def fp16_enabled(self) -> bool:
        return self.float16_config.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.bfloat16_config.enabled

    @property
    def user_dict(self) -> dict:
        """The config as the user gave it (what checkpoints save as ds_config, as DeepSpeed's do)."""
        return self._param_dict

    @property
    def zero_optimization(self) -> bool:
        return self.zero_enabled

    def model_dtype(self) -> torch.dtype:
        if self.fp16_enabled:
            return torch.float16
        if self.bfloat16_enabled:
            return torch.bfloat16
        return torch.float32

    def print_user_config(self) -> None:
        logger.info("  json = " + json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        logger.info(f"{name}:")
        for arg in sorted(vars(self)):
            if arg != "_param_dict" and not arg.startswith("_raw"):
                logger.info(f"  {arg} {'.' * (29 - len(arg))} {getattr(self, arg)}")
        self.print_user_config()


class _RawMonitorConfig:
    """Monitor sections held as given while deepspeed_c.monitor has no typed models."""

    def __init__(self, sections: dict[str, Any]) -> None:
        for key, value in sections.items():
            setattr(self, key, value)

    @property
    def enabled(self) -> bool:
        def on(section: Any) -> bool:
            return bool(section.get("enabled", False)) if isinstance(section, dict) else bool(
                getattr(section, "enabled", False))

        return any(on(getattr(self, k)) for k, _ in _MONITOR_SECTIONS)

