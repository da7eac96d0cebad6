"""From `optimizer: {"type": "Muon", "params": {...}}` to MuonWithAuxAdam's param groups, as DeepSpeed 0.19.8's
engine builds them.

Which parameters Muon steps: `deepspeed.initialize` flags every parameter of the model, `use_muon` = (ndim >= 2
and the parameter's name contains neither "embed" nor "lm_head"). The trainable flagged parameters form one
Muon group (keys lr, momentum, weight_decay, ns_method; `muon_lr` overrides lr), the other trainable ones one
Adam group (keys lr, betas, eps, weight_decay; `adam_lr` overrides lr); a model with no matrix gets only the
Adam group. Frozen parameters are in neither. DeepSpeed ignores keys it does not read; here an unknown key is an
error naming the closest valid one."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, unknown_key_error
from deepspeed_c.runtime.zero.muon.newton_schulz import NS_METHODS

MUON_GROUP_KEYS = ("lr", "momentum", "weight_decay", "muon_lr", "ns_method")
ADAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_lr")
MUON_CONFIG_KEYS = tuple(sorted(set(MUON_GROUP_KEYS) | set(ADAM_GROUP_KEYS)))
_NO_MUON_NAMES = ("embed", "lm_head")


def use_muon_for(name: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2 and not any(word in name.lower() for word in _NO_MUON_NAMES)


def set_optimizer_flags(config_class: Any, model: torch.nn.Module) -> None:
    """DeepSpeed's `deepspeed.set_optimizer_flags`: with the Muon optimizer configured, every parameter of the
    model gets its `use_muon` flag (overwriting any flag already there, as DeepSpeed's)."""
    name = getattr(config_class, "optimizer_name", config_class)
    if isinstance(name, str) and name.lower() == "muon":
        flag_parameters(model)


def flag_parameters(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        p.use_muon = use_muon_for(name, p)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.{key}' (Muon): "
                                   f"expected a number")
    return float(value)


def check_muon_params(params: dict[str, Any]) -> None:
    """The `optimizer.params` of a Muon optimizer: known keys only, values of the right kind."""
    for key, value in params.items():
        if key not in MUON_CONFIG_KEYS:
            raise unknown_key_error("optimizer.params", key, MUON_CONFIG_KEYS)
        if key == "ns_method":
            if value not in NS_METHODS:
                raise DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.ns_method' "
                                           f"(Muon): expected one of {list(NS_METHODS)}")
        elif key == "betas":
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.betas' "
                                           f"(Muon's Adam groups): expected a list of 2 numbers, e.g. [0.9, 0.95]")
            for b in value:
                if not 0.0 <= _number("betas", b) < 1.0:
                    raise DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.betas': "
                                               f"each must be in [0, 1)")
        else:
            v = _number(key, value)
            if key == "momentum" and not 0.0 <= v < 1.0:
                raise DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.momentum' "
                                           f"(Muon): expected a number in [0, 1)")
            if key != "momentum" and v < 0.0:
                raise DeepSpeedConfigError(f"Invalid value {value!r} for config key 'optimizer.params.{key}' "
                                           f"(Muon): expected a number >= 0")


def _flat_params(model_parameters: Iterable[Any]) -> list[torch.Tensor]:
    # DeepSpeed flattens param-group dicts (e.g. MoE's) into one parameter list
    out: list[torch.Tensor] = []
    for item in model_parameters:
        if isinstance(item, dict):
            out.extend(item["params"])
        else:
            out.append(item)
    return out


def _pick(params: dict[str, Any], keys: Iterable[str], override: str) -> dict[str, Any]:
    picked = {k: params[k] for k in keys if k in params and k != override}
    if override in params:
        picked["lr"] = params[override]
    if "betas" in picked:
        picked["betas"] = tuple(picked["betas"])
    return picked


def muon_param_groups(model_parameters: Iterable[Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """MuonWithAuxAdam's groups over model_parameters, from their use_muon flags and the config's params."""
    check_muon_params(params)
    all_params = _flat_params(model_parameters)
    unflagged = [tuple(p.shape) for p in all_params if not hasattr(p, "use_muon")]
    if unflagged:
        raise ValueError(f"The Muon optimizer is configured but {len(unflagged)} parameter(s) (shapes "
                         f"{unflagged[:4]}) have no use_muon flag: deepspeed.initialize sets it on the model's "
                         f"parameters; for others set `param.use_muon = True / False`")
    trainable = [p for p in all_params if p.requires_grad]
    muon = [p for p in trainable if p.use_muon]
    adam = [p for p in trainable if not p.use_muon]
    groups = []
    if muon:
        groups.append(dict(params=muon, use_muon=True, name="muon-params",
                           **_pick(params, MUON_GROUP_KEYS, "muon_lr")))
    if adam:
        groups.append(dict(params=adam, use_muon=False, name="adam-params",
                           **_pick(params, ADAM_GROUP_KEYS, "adam_lr")))
    if not groups:
        raise ValueError("The Muon optimizer got no trainable parameters")
    return groups
