"""ZeRO-3 leaf modules (DeepSpeed's deepspeed.utils.z3_leaf_module): a module flagged `_z3_leaf` is gathered
as one piece, all parameters below it at its forward and its backward, with no hooks on its children
(runtime/zero/param_hooks.py). For modules whose children run data-dependently (mixture-of-experts
layers: a rank may skip an expert another rank runs), so every rank gathers the same. Flag them before
deepspeed_c.initialize; accelerate's set_moe_leaf_modules calls set_z3_leaf_modules."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

if TYPE_CHECKING:  # nothing heavy at import: deepspeed_c.utils imports this module eagerly
    import torch

__all__ = ["z3_leaf_module", "z3_leaf_parameter", "get_z3_leaf_modules", "set_z3_leaf_module",
           "set_z3_leaf_modules", "unset_z3_leaf_modules"]

LEAF_ATTR = "_z3_leaf"  # the attribute param_hooks reads


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `model` is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(model, LEAF_ATTR, False))


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether a parameter belongs to a ZeRO-3 leaf module (DeepSpeed marks it `ds_z3_leaf_module`)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of `model` (itself included) flagged as a leaf, in modules() order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Flags (or unflags) one module."""
    setattr(model, LEAF_ATTR, bool(flag))


def _flag_classes(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]], flag: bool,
                  raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be a list of module classes or class names, got {bad!r}")
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}
    hits = [m for m in model.modules() if type(m) in types or type(m).__name__ in names]
    for m in hits:
        set_z3_leaf_module(m, flag)
    if not hits and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return hits


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Flags every module of `model` whose class is one of `leaf_module_classes` (classes, matched exactly,
    or class names) as a leaf; returns those modules. Raises ValueError when none matches (unless told not to)."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Clears the leaf flag of the modules set_z3_leaf_modules would flag; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)
