"""Optimizers from the config's `optimizer` section, by DeepSpeed's names.

As DeepSpeed's `_configure_basic_optimizer`: the DeepSpeedCPU* optimizers only with
`offload_optimizer` (cpu_optimizer=True); otherwise "Adam"/"AdamW" -> FusedAdam and "Lion" ->
FusedLion on every device (they step host tensors with the C CPU kernels), "Adagrad" ->
torch.optim.Adagrad. "Adam" means AdamW unless `adam_w_mode` is false, and `torch_adam: true` picks
torch.optim.Adam/AdamW instead. "Lamb" -> FusedLamb on a GPU, the torch CPULamb on the CPU.
"Muon" -> MuonWithAuxAdam over the parameters' use_muon flags (runtime/zero/muon/param_groups.py);
"MuSGD" -> muP's MuSGD from the `mup` package, as DeepSpeed's.
Any other name must be a torch.optim class (e.g. "SGD")."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Optional

import torch

from deepspeed_c.runtime.config.optim import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAM_W_MODE, ADAM_W_MODE_DEFAULT,
                                              ADAMW_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
                                              MUSGD_OPTIMIZER, TORCH_ADAM_PARAM)
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, closest


def _cls(path: str) -> type:
    module_name, _, name = path.rpartition(".")
    import importlib

    return getattr(importlib.import_module(module_name), name)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or isinstance(value, torch.Tensor)


def _value_error(cls: type, key: str, value: Any, expected: str) -> DeepSpeedConfigError:
    hint = ""
    if isinstance(value, str):
        try:
            hint = f"; write it as a JSON number, without quotes: {float(value)!r}"
        except ValueError:
            pass
    return DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.{key}' "
                                f"({cls.__name__}): expected {expected}{hint}")


def _check_values(cls: type, params: dict[str, Any]) -> None:
    """An argument whose default is a number (lr, eps, weight_decay, ...) or a tuple of numbers
    (betas) must be given as one. DeepSpeed 0.19.8 hands these to the optimizer unchecked, and a
    string such as "fast" or "1e-3" then fails in the optimizer (a comparison, or the first step's
    float conversion) without naming the key; here it is refused at initialize, naming it."""
    signature = inspect.signature(cls.__init__)
    for key, value in params.items():
        arg = signature.parameters.get(key)
        default = arg.default if arg is not None else inspect.Parameter.empty
        if _is_number(default) and not _is_number(value):
            raise _value_error(cls, key, value, f"a number (e.g. {default!r})")
        if isinstance(default, tuple) and default and all(_is_number(d) for d in default) and \
                not (isinstance(value, (list, tuple)) and all(_is_number(v) for v in value)):
            raise _value_error(cls, key, value, f"a list of {len(default)} numbers (e.g. {list(default)!r})")


def _check_params(cls: type, params: dict[str, Any], extra_ok: Iterable[str] = ()) -> None:
    """Every `optimizer.params` key must be a constructor argument of the class it goes to, and a
    numeric argument must be a number."""
    _check_values(cls, params)
    signature = inspect.signature(cls.__init__)
    if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        return
    valid = [n for n in signature.parameters if n not in ("self", "params", "model_params")] + list(extra_ok)
    for key in params:
        if key not in valid:
            near = closest(key, valid)
            hint = f" Did you mean '{near}'?" if near else ""
            raise DeepSpeedConfigError(
                f"Unknown config key 'optimizer.params.{key}' for {cls.__name__}.{hint} "
                f"Valid keys: {', '.join(sorted(valid))}")


def _build(cls: type, model_parameters: Any, params: dict[str, Any]) -> torch.optim.Optimizer:
    _check_params(cls, params)
    try:
        return cls(model_parameters, **params)
    except (TypeError, ValueError) as e:
        raise DeepSpeedConfigError(f"Invalid 'optimizer.params' for {cls.__name__}: {e}") from None


def build_optimizer(name: str, params: Optional[dict[str, Any]], model_parameters: Any,
                    device: torch.device, cpu_optimizer: Optional[bool] = None,
                    deepspeed: Any = None) -> torch.optim.Optimizer:
    """The basic optimizer for `optimizer.type` = name (already normalised by the config).
    cpu_optimizer: ZeRO-Offload's host optimizer is wanted (the engine passes whether offload_optimizer is
    on); None means "whenever device is the host". deepspeed: the engine, which the 1-bit optimizers
    (OneBitAdam, ZeroOneAdam, OneBitLamb) are given, as DeepSpeed's."""
    params = dict(params or {})
    from deepspeed_c.runtime.fp16.onebit.factory import ONEBIT_OPTIMIZERS, build_onebit_optimizer, is_onebit

    if is_onebit(name):
        module_name, cls_name, _ = ONEBIT_OPTIMIZERS[name]
        _check_values(_cls(f"{module_name}.{cls_name}"), params)
        return build_onebit_optimizer(name, params, model_parameters, deepspeed)
    on_gpu = device.type == "cuda"
    use_cpu_optimizer = (not on_gpu) if cpu_optimizer is None else bool(cpu_optimizer)
    if name in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        torch_adam = params.pop(TORCH_ADAM_PARAM, False)
        adam_w_mode = params.pop(ADAM_W_MODE, ADAM_W_MODE_DEFAULT)
        effective_w_mode = name == ADAMW_OPTIMIZER or bool(adam_w_mode)
        if torch_adam:
            cls = torch.optim.AdamW if effective_w_mode else torch.optim.Adam
            return _build(cls, model_parameters, params)
        if not use_cpu_optimizer:
            cls = _cls("deepspeed_c.ops.adam.FusedAdam")
            _check_params(cls, params)
            return cls(model_parameters, **params, adam_w_mode=effective_w_mode)
        cls = _cls("deepspeed_c.ops.adam.DeepSpeedCPUAdam")
        _check_params(cls, params)
        return cls(model_parameters, **params, adamw_mode=effective_w_mode)
    if name == ADAGRAD_OPTIMIZER:
        cls = _cls("deepspeed_c.ops.adagrad.DeepSpeedCPUAdagrad") if use_cpu_optimizer else torch.optim.Adagrad
        return _build(cls, model_parameters, params)
    if name == LION_OPTIMIZER:
        cls = _cls("deepspeed_c.ops.lion.DeepSpeedCPULion" if use_cpu_optimizer else "deepspeed_c.ops.lion.FusedLion")
        return _build(cls, model_parameters, params)
    if name == LAMB_OPTIMIZER:
        cls = _cls("deepspeed_c.ops.lamb.FusedLamb" if on_gpu else "deepspeed_c.ops.lamb.cpu_lamb.CPULamb")
        return _build(cls, model_parameters, params)
    if name == MUON_OPTIMIZER:
        return _build_muon(model_parameters, params, bool(cpu_optimizer), getattr(deepspeed, "module", None))
    if name == MUSGD_OPTIMIZER:
        try:
            from mup import MuSGD
        except ImportError:
            raise ImportError("optimizer.type 'MuSGD' is muP's MuSGD from the `mup` package, which is not installed: "
                              "pip install mup (and call mup.set_base_shapes on the model first)") from None
        return _build(MuSGD, model_parameters, params)
    cls = getattr(torch.optim, name, None)
    if cls is None:
        raise DeepSpeedConfigError(f"Invalid value {name!r} for config key 'optimizer.type'")
    return _build(cls, model_parameters, params)


def _build_muon(model_parameters: Any, params: dict[str, Any], cpu_optimizer: bool,
                module: Optional[torch.nn.Module]) -> torch.optim.Optimizer:
    """DeepSpeed's engine: Muon for the parameters flagged use_muon, Adam for the rest. The flags are set on the
    engine's module here, as deepspeed.initialize sets them on the model."""
    from deepspeed_c.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed_c.runtime.zero.muon.param_groups import flag_parameters, muon_param_groups

    if cpu_optimizer:
        raise NotImplementedError("deepspeed_c: the Muon optimizer with zero_optimization.offload_optimizer is not "
                                  "built (Newton-Schulz needs whole matrices on the device); remove offload_optimizer")
    if module is not None:
        flag_parameters(module)
    return MuonWithAuxAdam(muon_param_groups(model_parameters, params))


def is_optimizer_callable(obj: Any) -> bool:
    return callable(obj) and not isinstance(obj, torch.optim.Optimizer)


OptimizerCallable = Callable[[Any], torch.optim.Optimizer]
