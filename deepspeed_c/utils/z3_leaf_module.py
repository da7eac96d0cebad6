"""ZeRO-3 leaf modules (DeepSpeed's deepspeed.utils.z3_leaf_module): a module flagged `_z3_leaf` is gathered
as one piece, all parameters below it at its forward and its backward, with no hooks on its children
(runtime/zero/param_hooks.py). For modules whose children run data-dependently (mixture-of-experts
layers: a rank may skip an expert another rank runs), so every rank gathers the same. Flag them before
deepspeed_c.initialize; accelerate's set_moe_leaf_modules calls set_z3_leaf_modules."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Tuple, Union

if TYPE_CHECKING:  # nothing heavy at import: deepspeed_c.utils imports this module eagerly
    import torch

__all__ = ["z3_leaf_module", "z3_leaf_parameter", "get_z3_leaf_modules", "set_z3_leaf_module",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix"]

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


def _qualified_name(m: torch.nn.Module) -> str:
    cls = type(m)
    return f"{cls.__module__}.{cls.__qualname__}"


def _flag_classes(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]], flag: bool,
                  raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be a list of module classes or class names, got {bad!r}")
    # as DeepSpeed: a class matches its subclasses too; a string matches the class name or its qualified name
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}
    hits = [m for m in model.modules()
            if isinstance(m, types) or type(m).__name__ in names or _qualified_name(m) in names]
    for m in hits:
        set_z3_leaf_module(m, flag)
    if not hits and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return hits


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[list[torch.nn.Module], list[str]]:
    """Flags the modules named (as `model.named_modules()` names them); returns (the modules, the names not
    found). Raises ValueError naming the missing ones unless told not to."""
    by_name = dict(model.named_modules())
    hits = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in hits:
        set_z3_leaf_module(m, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return hits, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[list[torch.nn.Module], list[str]]:
    """Flags every module whose `named_modules()` name ends with one of the suffixes; returns (the modules,
    each once, the suffixes nothing matched). Raises ValueError naming those unless told not to."""
    named = list(model.named_modules())
    hits: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        matched = [m for n, m in named if n.endswith(suffix)]
        if not matched:
            missing.append(suffix)
        for m in matched:
            set_z3_leaf_module(m, flag)
            hits.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    return list(hits.values()), missing


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Flags every module of `model` that is an instance of one of `leaf_module_classes` (classes, or class
    names plain or qualified) as a leaf; returns those modules. Raises ValueError when none matches (unless told
    not to)."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Clears the leaf flag of the modules set_z3_leaf_modules would flag; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)
