"""The typed `optimizer` and `scheduler` sections. Names follow DeepSpeed: its own optimizers
are matched case-insensitively (and stored lower-case), any other name must be a torch.optim
class; schedulers are deepspeed_c.runtime.lr_schedules classes or torch.optim.lr_scheduler ones."""
from __future__ import annotations

from typing import Any, Optional

import torch
from deepspeed_c.runtime.config.utils import (DeepSpeedConfigError, DeepSpeedConfigModel, closest, model_keys,
                                              unknown_key_error,
                                              parse_section, unbuilt)

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER,
    LION_OPTIMIZER, MUON_OPTIMIZER,
]
BUILT_DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER,
                              ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, MUON_OPTIMIZER,
                              MUSGD_OPTIMIZER]
_UNBUILT_OPTIMIZERS = {
    MUADAM_OPTIMIZER: "the muP MuAdam optimizer",
    MUADAMW_OPTIMIZER: "the muP MuAdamW optimizer",
}

TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
MAX_GRAD_NORM = "max_grad_norm"


def _torch_optimizer_names() -> list[str]:
    return [n for n in dir(torch.optim)
            if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
            and n != "Optimizer"]


class OptimizerSection(DeepSpeedConfigModel):
    type: Optional[str] = None
    params: Optional[dict[str, Any]] = None
    legacy_fusion: bool = False


class SchedulerSection(DeepSpeedConfigModel):
    type: Optional[str] = None
    params: Optional[dict[str, Any]] = None


def normalize_optimizer_name(name: str) -> str:
    """DeepSpeed's own optimizers go lower-case; a torch.optim name keeps its spelling."""
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return name.lower()
    if getattr(torch.optim, name, None) is not None:
        return name
    valid = ["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon", "MuSGD"]
    valid += _torch_optimizer_names()
    near = closest(name, valid)
    hint = f" Did you mean '{near}'?" if near else ""
    raise DeepSpeedConfigError(
        f"Invalid value {name!r} for config key 'optimizer.type': not a DeepSpeed optimizer nor a torch.optim "
        f"class.{hint} Allowed: Adam, AdamW, Lamb, Lion, Adagrad, Muon, MuSGD, or a torch.optim class name such as SGD")


def _drop_unread_optimizer_keys(raw: Any) -> Any:
    """DeepSpeed reads only `type`, `params` and `legacy_fusion` of this section and ignores any other
    key beside them (e.g. a misplaced `torch_adam`); so do we, with a warning naming it. A near miss of
    a key it reads (`parms`) is still refused: silently training without the user's params is worse."""
    if not isinstance(raw, dict):
        return raw
    known = model_keys(OptimizerSection)
    for key in raw:
        if key not in known and closest(str(key), known) is not None:
            raise unknown_key_error("optimizer", str(key), known)
    extra = sorted(k for k in raw if k not in known)
    if not extra:
        return raw
    from deepspeed_c.utils.logging import logger

    logger.warning(f"Config keys {', '.join(f'optimizer.{k}' for k in extra)} are not read (DeepSpeed ignores "
                   "keys beside 'type' and 'params' in this section; optimizer arguments go in 'optimizer.params')")
    return {k: v for k, v in raw.items() if k in known}


def parse_optimizer(param_dict: dict[str, Any]) -> OptimizerSection:
    section = parse_section(OptimizerSection, _drop_unread_optimizer_keys(param_dict.get("optimizer")), "optimizer")
    if section.type is None:
        if section.params:
            raise DeepSpeedConfigError("Config key 'optimizer.params' is given without 'optimizer.type'")
        return section
    section.type = normalize_optimizer_name(section.type)
    if section.type in _UNBUILT_OPTIMIZERS:
        raise unbuilt("optimizer.type", _UNBUILT_OPTIMIZERS[section.type])
    params = dict(section.params or {})
    if MAX_GRAD_NORM in params:
        raise DeepSpeedConfigError(
            "Config key 'optimizer.params.max_grad_norm' is not supported; use the top-level "
            "'gradient_clipping' instead")
    if section.type == MUON_OPTIMIZER:  # its keys are checked here, before any model is touched
        from deepspeed_c.runtime.zero.muon.param_groups import check_muon_params

        check_muon_params(params)
    section.params = params
    return section


def _valid_scheduler_names() -> list[str]:
    names: list[str] = []
    try:
        from deepspeed_c.runtime import lr_schedules

        names += list(getattr(lr_schedules, "VALID_LR_SCHEDULES", []))
    except ImportError:
        names += ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    names += [n for n in dir(torch.optim.lr_scheduler)
              if isinstance(getattr(torch.optim.lr_scheduler, n), type) and n[0].isupper()]
    return names


def parse_scheduler(param_dict: dict[str, Any]) -> SchedulerSection:
    section = parse_section(SchedulerSection, param_dict.get("scheduler"), "scheduler")
    if section.type is None:
        if section.params:
            raise DeepSpeedConfigError("Config key 'scheduler.params' is given without 'scheduler.type'")
        return section
    valid = _valid_scheduler_names()
    if section.type not in valid:
        near = closest(section.type, valid)
        hint = f" Did you mean '{near}'?" if near else ""
        raise DeepSpeedConfigError(
            f"Invalid value {section.type!r} for config key 'scheduler.type': unknown LR scheduler.{hint} "
            f"Allowed: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR, or a "
            f"torch.optim.lr_scheduler class name")
    section.params = dict(section.params or {})
    return section

