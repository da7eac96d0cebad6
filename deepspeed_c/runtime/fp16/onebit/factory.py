"""The 1-bit optimizers from the config's `optimizer` section ("OneBitAdam", "ZeroOneAdam",
"OneBitLamb"), with DeepSpeed's checks: ZeRO (any stage) or optimizer offload refused ("... is not
compatible with ZeRO"), 1-bit LAMB under fp16 needs dynamic loss scaling, and a warning outside
fp16 (DeepSpeed verified their convergence under fp16 only). The engine is handed to the optimizer
(DeepSpeed's `deepspeed` argument): it switches the engine's gradient all-reduce off once it
compresses, since from then on it communicates itself."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from deepspeed_c.runtime.config.optim import ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, closest

ONEBIT_OPTIMIZERS = {
    ONEBIT_ADAM_OPTIMIZER: ("deepspeed_c.runtime.fp16.onebit.adam", "OnebitAdam", "1bit-Adam"),
    ZERO_ONE_ADAM_OPTIMIZER: ("deepspeed_c.runtime.fp16.onebit.zoadam", "ZeroOneAdam", "0/1 Adam"),
    ONEBIT_LAMB_OPTIMIZER: ("deepspeed_c.runtime.fp16.onebit.lamb", "OnebitLamb", "1bit-Lamb"),
}


class OnebitZeroError(DeepSpeedConfigError, AssertionError):
    """A 1-bit optimizer with ZeRO or offload: a config error, and an AssertionError as DeepSpeed's."""


def is_onebit(name: Any) -> bool:
    return name in ONEBIT_OPTIMIZERS


def build_onebit_optimizer(name: str, params: dict[str, Any], model_parameters: Any,
                           deepspeed: Any = None) -> torch.optim.Optimizer:
    import importlib

    module, cls_name, label = ONEBIT_OPTIMIZERS[name]
    if deepspeed is not None:
        stage = int(deepspeed.zero_optimization_stage())
        if stage > 0:
            raise OnebitZeroError(f"{label} is not compatible with ZeRO: zero_optimization.stage is {stage}; the 1-bit "
                                  "optimizers run at stage 0 only (set zero_optimization.stage to 0)")
        if deepspeed.zero_use_cpu_optimizer():
            raise OnebitZeroError(f"{label} is not compatible with ZeRO: zero_optimization.offload_optimizer is set; "
                                  "the 1-bit optimizers cannot be offloaded")
        if name == ONEBIT_LAMB_OPTIMIZER and deepspeed.fp16_enabled() and not deepspeed.dynamic_loss_scale():
            raise OnebitZeroError(f"DeepSpeed {name} optimizer requires dynamic loss scaling: fp16.loss_scale is "
                                  f"{deepspeed.loss_scale()}; set it to 0")
        if not deepspeed.fp16_enabled():
            from deepspeed_c.utils.logging import logger

            logger.warning(f"Currently the convergence of {label.replace('bit-', '-bit ')} is only verified under FP16")
    cls = getattr(importlib.import_module(module), cls_name)
    valid = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params", "deepspeed")]
    for key in params:
        if key not in valid:
            near = closest(key, valid)
            hint = f" Did you mean '{near}'?" if near else ""
            raise DeepSpeedConfigError(f"Unknown config key 'optimizer.params.{key}' for {cls_name}.{hint} "
                                       f"Valid keys: {', '.join(sorted(valid))}")
    try:
        return cls(model_parameters, deepspeed, **params)
    except TypeError as e:
        raise DeepSpeedConfigError(f"Invalid 'optimizer.params' for {cls_name}: {e}") from None
