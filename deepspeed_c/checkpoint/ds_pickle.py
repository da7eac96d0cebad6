"""Writing DeepSpeed's own checkpoint objects without DeepSpeed.

DeepSpeed's checkpoints hold a few pickled objects of its classes (the ZeRO optimizer's loss scaler,
the ZeRO stage enum, per-parameter `fragment_address` records), and its loader calls their methods,
so a checkpoint DeepSpeed is to load must name those classes. deepspeed_c builds the stand-ins of
safe_load (attributes only) and pickles each under the DeepSpeed name it stands for: DeepSpeed's
unpickler then builds its own class from the same attributes, and deepspeed_c's weights_only loader
maps the name back to the stand-in. The name is written directly into the pickle stream (the stand-in
is never importable under it: the standard pickler would refuse). Imports only torch and the standard
library."""
from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any, Mapping, Sequence

from deepspeed_c.checkpoint.safe_load import (DEEPSPEED_GLOBALS, DynamicLossScalerStandIn, FragmentAddressStandIn,
                                              LossScalerStandIn, ZeroStageStandIn)

# stand-in class -> (module, qualified name) DeepSpeed defines it under
_NAMES: dict[type, tuple[str, str]] = {cls: tuple(name.rsplit(".", 1)) for cls, name in DEEPSPEED_GLOBALS}
STAND_IN_TYPES: tuple[type, ...] = tuple(_NAMES)


class Pickler(pickle._Pickler):  # type: ignore[name-defined]  # the Python pickler: save_global can be overridden
    """pickle.Pickler that writes each stand-in class as the DeepSpeed global it stands for."""

    def save_global(self, obj: Any, name: Any = None) -> None:
        target = _NAMES.get(obj) if isinstance(obj, type) else None
        if target is None:
            super().save_global(obj, name)
            return
        module, qualname = target
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qualname.encode("utf-8") + b"\n")
        self.memoize(obj)


# what torch.save(..., pickle_module=...) uses from a pickle module
Unpickler = pickle.Unpickler
dump = pickle.dump
load = pickle.load


def contains_stand_ins(obj: Any) -> bool:
    """Whether `obj` (nested dicts/lists/tuples) holds any stand-in object."""
    if isinstance(obj, STAND_IN_TYPES):
        return True
    if isinstance(obj, Mapping):
        return any(contains_stand_ins(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(contains_stand_ins(v) for v in obj)
    return False


# DeepSpeed 0.19.8's LossScaler / DynamicLossScaler instance attributes (their __init__ sets these)
STATIC_SCALER_ATTRS = ("cur_scale", "dynamic")
DYNAMIC_SCALER_ATTRS = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
                        "min_scale", "delayed_shift", "cur_hysteresis", "consecutive_hysteresis",
                        "raise_error_at_min_scale", "dtype")


def loss_scaler_record(scaler: Any) -> LossScalerStandIn:
    """The loss scaler as DeepSpeed pickles it: a LossScaler (static) or DynamicLossScaler object with
    DeepSpeed's attribute set, read from `scaler` (deepspeed_c's scalers keep DeepSpeed's attributes)."""
    if scaler is None:
        return LossScalerStandIn(cur_scale=1.0, dynamic=False)
    dynamic = bool(getattr(scaler, "dynamic", False))
    names = DYNAMIC_SCALER_ATTRS if dynamic else STATIC_SCALER_ATTRS
    missing = [n for n in names if not hasattr(scaler, n)]
    if missing:
        raise TypeError(f"loss scaler {type(scaler).__name__} lacks DeepSpeed's attributes {missing}")
    attrs = {n: getattr(scaler, n) for n in names}
    attrs["cur_scale"] = float(attrs["cur_scale"])
    return (DynamicLossScalerStandIn if dynamic else LossScalerStandIn)(**attrs)


def zero_stage_record(stage: int) -> ZeroStageStandIn:
    return ZeroStageStandIn(int(stage))


def fragment_record(numel: int, start: int) -> FragmentAddressStandIn:
    return FragmentAddressStandIn(numel=int(numel), start=int(start))


def param_slice_mappings(names: Sequence[Sequence[str]], slices: Sequence[Sequence[tuple[int, int, int]]]
                         ) -> list[OrderedDict[str, FragmentAddressStandIn]]:
    """DeepSpeed's `param_slice_mappings`: per group, for each parameter with elements in this rank's
    partition (in parameter order), where they start in the partition and how many there are.
    `slices[g]` lists (param index, local start, length) of group g on this rank."""
    out = []
    for group_names, group_slices in zip(names, slices):
        mapping: OrderedDict[str, FragmentAddressStandIn] = OrderedDict()  # DeepSpeed's container
        for index, start, length in sorted(group_slices, key=lambda s: s[1]):
            if length > 0:
                mapping[group_names[index]] = fragment_record(length, start)
        out.append(mapping)
    return out
