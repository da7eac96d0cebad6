"""The batch triple: train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * data-parallel world size, completed from any two (or from one, as
DeepSpeed does) and checked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchTriple:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _positive(value: Any, key: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        # DeepSpeed 0.19.8 reads these keys from the raw dict and fails on a string ("4" > 0 is a
        # TypeError), unlike zero_optimization.stage, which its pydantic model coerces: refuse it too,
        # but say which key and how to write it
        hint = ""
        if isinstance(value, str) and value.strip().isdigit() and int(value) > 0:
            hint = f" (a JSON number: write {int(value)} without quotes, not the string {value!r})"
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key '{key}': expected an int > 0{hint}")
    return value


def resolve_batch(train_batch: Any, micro_batch: Any, grad_acc: Any, world_size: int) -> BatchTriple:
    train_batch = _positive(train_batch, TRAIN_BATCH_SIZE)
    micro_batch = _positive(micro_batch, TRAIN_MICRO_BATCH_SIZE_PER_GPU)
    grad_acc = _positive(grad_acc, GRADIENT_ACCUMULATION_STEPS)
    if world_size <= 0:
        raise DeepSpeedConfigError(f"data-parallel world size must be > 0, got {world_size}")

    if train_batch is not None and micro_batch is not None and grad_acc is not None:
        pass
    elif train_batch is not None and micro_batch is not None:
        grad_acc = train_batch // micro_batch // world_size
    elif train_batch is not None and grad_acc is not None:
        micro_batch = train_batch // world_size // grad_acc
    elif micro_batch is not None and grad_acc is not None:
        train_batch = micro_batch * grad_acc * world_size
    elif train_batch is not None:
        grad_acc = 1
        micro_batch = train_batch // world_size
    elif micro_batch is not None:
        grad_acc = 1
        train_batch = micro_batch * world_size
    else:
        raise DeepSpeedConfigError(
            f"Either '{TRAIN_BATCH_SIZE}' or '{TRAIN_MICRO_BATCH_SIZE_PER_GPU}' must be given in the config")

    if not micro_batch or not grad_acc or train_batch != micro_batch * grad_acc * world_size:
        raise DeepSpeedConfigError(
            f"Inconsistent batch config: '{TRAIN_BATCH_SIZE}' ({train_batch}) must equal "
            f"'{TRAIN_MICRO_BATCH_SIZE_PER_GPU}' ({micro_batch}) * '{GRADIENT_ACCUMULATION_STEPS}' ({grad_acc}) "
            f"* data-parallel world size ({world_size})")
    return BatchTriple(train_batch, micro_batch, grad_acc)
