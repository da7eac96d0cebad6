"""Chooses the accelerator once per process: DS_ACCELERATOR if set (cpu or cuda), else cuda when
torch sees a GPU, else cpu."""
from __future__ import annotations

import os

from deepspeed_c.accelerator.abstract_accelerator import DeepSpeedAccelerator

SUPPORTED_ACCELERATOR_LIST = ["cpu", "cuda"]
_accelerator: DeepSpeedAccelerator | None = None


def _make(name: str) -> DeepSpeedAccelerator:
    if name == "cuda":
        from deepspeed_c.accelerator.cuda_accelerator import CUDA_Accelerator

        acc: DeepSpeedAccelerator = CUDA_Accelerator()
        if not acc.is_available():
            raise ValueError("DS_ACCELERATOR=cuda but torch sees no CUDA device")
        return acc
    if name == "cpu":
        from deepspeed_c.accelerator.cpu_accelerator import CPU_Accelerator

        return CPU_Accelerator()
    raise ValueError(f"DS_ACCELERATOR must be one of {SUPPORTED_ACCELERATOR_LIST}, got {name!r}")


def get_accelerator() -> DeepSpeedAccelerator:
    global _accelerator
    if _accelerator is None:
        name = os.environ.get("DS_ACCELERATOR")
        if name is None:
            import torch

            name = "cuda" if torch.cuda.is_available() else "cpu"
        _accelerator = _make(name)
    return _accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    global _accelerator
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED_ACCELERATOR_LIST
