"""Dotted-path attribute access on modules (DeepSpeed's deepspeed.utils.module_utils): "layers.3.mlp"."""
from __future__ import annotations

from typing import Any


def recursive_getattr(model: Any, module_name: str) -> Any:
    """model.<a>.<b>... for module_name "a.b..."; AttributeError names the first missing part."""
    out = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Sets the last part of the dotted path on the object the rest of it names."""
    head, _, last = module_name.rpartition(".")
    owner = recursive_getattr(model, head) if head else model
    setattr(owner, last, module)
