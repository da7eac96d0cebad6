"""DeepSpeed's `deepspeed.runtime.torch_autocast` helpers: which modules' parameters may
communicate in the autocast dtype, and whether autocast was set up."""
from __future__ import annotations

import importlib
from typing import Any, Iterable, Optional

import torch

from deepspeed_c.runtime.config.precision import DEFAULT_LOWER_PRECISION_SAFE_MODULES

PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
_STATE: dict[str, Any] = {"initialized": False, "dtype": None}


def get_default_autocast_lower_precision_modules() -> list[str]:
    return list(DEFAULT_LOWER_PRECISION_SAFE_MODULES)


def _classes(names: Iterable[str]) -> list[type]:
    out = []
    for name in names:
        package, _, cls_name = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(package), cls_name))
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"Failed to import lower precision safe module {name}: {e}") from None
    return out


def init_autocast_params(model: torch.nn.Module, dtype: torch.dtype,
                         torch_autocast_lower_precision_safe_modules: Optional[list[str]]) -> None:
    """Marks the parameters of model's lower-precision-safe modules with `comm_dtype` = dtype. DeepSpeed's
    callers pass the engine, an nn.Module holding the model: its module tree is the model's."""
    names = torch_autocast_lower_precision_safe_modules or get_default_autocast_lower_precision_modules()
    classes = tuple(_classes(names))
    for module in model.modules():
        if type(module) in classes:
            for p in module.parameters(recurse=False):
                setattr(p, PARAM_COMM_DTYPE_ATTR_NAME, dtype)
    _STATE.update(initialized=True, dtype=dtype)


def is_autocast_initialized() -> bool:
    return bool(_STATE["initialized"])


def get_autocast_dtype() -> Optional[torch.dtype]:
    return _STATE["dtype"]


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)
