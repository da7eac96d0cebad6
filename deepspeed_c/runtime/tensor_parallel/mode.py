"""AutoTP's process-wide mode (DeepSpeed's AUTOTP_MODE / set_autotp_mode): TRAINING after tp_model_init or
set_autotp_mode(training=True), INFERENCE otherwise. deepspeed_c's tensor-parallel layers (module_inject/layers.py)
always carry their gradients through autograd, so the mode changes no result here; it is kept so that scripts
which set it and code which reads it (is_autotp_training_mode) behave as under DeepSpeed."""
from __future__ import annotations

from enum import Enum


class AUTOTP_MODE(Enum):  # noqa: N801 (DeepSpeed's name)
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


_mode = AUTOTP_MODE.INFERENCE


def set_autotp_mode(training: bool = False) -> None:
    global _mode
    _mode = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


def get_auto_tp_mode() -> AUTOTP_MODE:
    return _mode


def is_autotp_training_mode() -> bool:
    return _mode is AUTOTP_MODE.TRAINING
