"""Layer partitioning of a PipelineModule: DeepSpeed's partition_uniform and partition_balanced
(prefix-sum dynamic programming in C, csrc/core/pipe_partition.c) and the methods 'uniform',
'parameters' and 'type:<regex>'."""
from __future__ import annotations

import re
from typing import Any, Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """num_parts + 1 boundaries; the first num_items % num_parts parts get one item more."""
    from deepspeed_c import _C

    return _C.pipe_partition_uniform(int(num_items), int(num_parts))


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of contiguous parts minimising (heaviest - lightest) part."""
    from deepspeed_c import _C

    return _C.pipe_partition_balanced([float(w) for w in weights], int(num_parts))


def layer_name(layer: Any) -> Any:
    """The type name DeepSpeed matches 'type:' regexes against (None for a nameless callable)."""
    from .module import LayerSpec

    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if hasattr(layer, "parameters") and hasattr(layer, "forward"):
        return layer.__class__.__name__
    return getattr(layer, "__name__", None)


def partition_layers(specs: list, num_stages: int, method: str, param_count: Any) -> list[int]:
    """Stage boundaries of `specs` for a partition method (case-insensitive as DeepSpeed's)."""
    if not isinstance(method, str):
        raise TypeError(f"partition_method must be a str, got {method!r}")
    m = method.lower()
    if m == "uniform":
        return partition_uniform(len(specs), num_stages)
    if m == "parameters":
        return partition_balanced([param_count(s) for s in specs], num_stages)
    if m.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [0] * len(specs)
        for i, s in enumerate(specs):
            name = layer_name(s)
            if name is not None and pattern.search(name):
                weights[i] = 1
        if not any(weights):
            raise RuntimeError(f"Partitioning '{method.split(':', 1)[1]}' found no valid layers to partition.")
        return partition_balanced(weights, num_stages)
    raise NotImplementedError(f"Partitioning method {method} not implemented (partition_method must be "
                              "'parameters', 'uniform' or 'type:<regex>')")
