"""The checkpoint settings, read once from the parsed config: what the checkpointers need of the
config, so they never read the engine's config (or its raw dict) themselves."""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Optional

from deepspeed_c.runtime.checkpointing.async_writer import WriterConfig


def plain_config(value: Any) -> Any:
    """The user's config as saved into checkpoints: enum members (DeepSpeed's own tests put OffloadDeviceEnum in
    config dicts) become their values and paths strings, so the file holds only what weights_only loading allows
    and resumes, here or under DeepSpeed."""
    if isinstance(value, dict):
        return {k: plain_config(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain_config(v) for v in value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


@dataclass(frozen=True)
class CheckpointOptions:
    """tag_validation / tag_validation_fail: checkpoint.tag_validation (Warn / Fail; Ignore: off);
    node_local_storage: checkpoint.use_node_local_storage; parallel_write_pipeline:
    checkpoint.parallel_write.pipeline_stage; load_from_fp32_weights: zero_optimization's key;
    bf16: bf16.enabled (names the ZeRO files bf16_*); zero_stage: zero_optimization.stage;
    ds_config: the user's config, saved into the files as DeepSpeed does (the dict itself, not a
    copy: a save writes the config as it is then); load_universal: checkpoint.load_universal (load_checkpoint
    reads a universal checkpoint, runtime/checkpointing/universal_load.py)."""
    tag_validation: bool
    tag_validation_fail: bool
    node_local_storage: bool
    parallel_write_pipeline: bool
    load_from_fp32_weights: bool
    bf16: bool
    zero_stage: int
    ds_config: dict
    load_universal: bool = False
    writer: Optional[Any] = None  # checkpoint.writer parsed (async_writer.WriterConfig); None: synchronous
    gradient_clipping: float = 0.0  # the configured value (a pipeline's ZeRO files carry it, as DeepSpeed's)

    @classmethod
    def from_config(cls, config: Any) -> "CheckpointOptions":
        """`config`: a parsed DeepSpeedConfig."""
        return cls(tag_validation=bool(config.checkpoint_tag_validation_enabled),
                   tag_validation_fail=bool(config.checkpoint_tag_validation_fail),
                   node_local_storage=bool(config.use_node_local_storage),
                   parallel_write_pipeline=bool(config.checkpoint_parallel_write_pipeline),
                   load_from_fp32_weights=bool(config.zero_config.load_from_fp32_weights),
                   bf16=bool(config.bfloat16_enabled), zero_stage=int(config.zero_optimization_stage),
                   ds_config=plain_config(config.user_dict),
                   load_universal=bool(getattr(config, "load_universal_checkpoint", False)),
                   # DeepSpeed's precedence: checkpoint.writer, else datastates_ckpt (on the same writer)
                   writer=(WriterConfig.parse(config.checkpoint_config.writer)
                           or WriterConfig.from_datastates((config.user_dict or {}).get("datastates_ckpt"))),
                   gradient_clipping=float(config.gradient_clipping or 0.0))

    @property
    def zero(self) -> bool:
        return self.zero_stage > 0

    @property
    def partition_weights(self) -> bool:
        """ZeRO-3: parameters are partitioned over the data-parallel ranks."""
        return self.zero_stage >= 3
