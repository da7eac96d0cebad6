"""convert_to_random_ltd (wrap every layer of a class in RandomLayerTokenDrop, then let the engine configure
them) and the state-dict helpers that drop the wrapper from parameter names for export."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from torch.nn import Module

from deepspeed_c.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop

_WRAPPED = ".random_ltd_layer"


def _inner(model: Any) -> Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, Module) else model


def _replace(root: Module, dotted: str, new: Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent.register_module(child, new)


def convert_to_random_ltd(model: Any, convert_type: type) -> Any:
    """Wraps every `convert_type` layer of the engine's module and calls `model.random_ltd_initialize()`
    (the engine: it hands each wrapper the scheduler and its layer id from the config)."""
    if not callable(getattr(model, "random_ltd_initialize", None)):
        raise TypeError("convert_to_random_ltd: pass the engine returned by deepspeed_c.initialize (with "
                        "data_efficiency.data_routing.random_ltd enabled), not the bare model")
    root = _inner(model)
    names = [name for name, m in root.named_modules() if isinstance(m, convert_type) and name]
    if not names:
        raise ValueError(f"convert_to_random_ltd: the model has no {convert_type.__name__} layer to wrap "
                         f"(random_ltd layer class {convert_type.__name__!r} not found)")
    for name in names:
        _replace(root, name, RandomLayerTokenDrop(root.get_submodule(name)))
    model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """The state dict with the wrappers' `.random_ltd_layer` removed from every key (the unwrapped model's names)."""
    return OrderedDict((key.replace(_WRAPPED, ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: Any) -> "OrderedDict[str, Any]":
    return remove_random_ltd_state_dict(_inner(model).state_dict())
