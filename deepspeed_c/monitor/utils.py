"""Helpers shared by the monitor backends: the writing rank and optional-package checks."""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


class MonitorBackendUnavailable(ImportError):
    """An enabled monitor section needs a package that is not installed (or too old)."""


def monitor_rank() -> int:
    """This process's global rank: torch.distributed's when initialised, else RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def require_backend(section: str, module: str, install: str, min_version: str | None = None) -> ModuleType:
    """Import `module` for the `section` config block, or raise MonitorBackendUnavailable saying what to do."""
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise MonitorBackendUnavailable(
            f"the '{section}' section of the DeepSpeed config is enabled, but the '{module}' package is not "
            f"installed: run `pip install {install}`, or set \"{section}\": {{\"enabled\": false}}") from err
    if min_version is not None:
        found = getattr(mod, "__version__", "0")
        if _version_tuple(found) < _version_tuple(min_version):
            raise MonitorBackendUnavailable(
                f"the '{section}' section needs {module} >= {min_version}, found {found}: "
                f"run `pip install \"{install}\"`")
    return mod


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def check_tb_availability() -> None:
    # torch.utils.tensorboard fails without the tensorboard package.
    require_backend("tensorboard", "tensorboard", "tensorboard")


def check_wandb_availability() -> None:
    require_backend("wandb", "wandb", "wandb")


def check_comet_availability() -> None:
    require_backend("comet", "comet_ml", "comet_ml>=3.41.0", min_version="3.41.0")


def check_trackio_availability() -> None:
    require_backend("trackio", "trackio", "trackio")


def event_value(value: object) -> object:
    """A plain Python number for a 0-d tensor or numpy scalar; other values unchanged."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value
