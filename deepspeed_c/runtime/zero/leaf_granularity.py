"""`stage3_module_granularity_threshold`: modules too fine-grained to be worth a gather of their own become
ZeRO-3 leaf modules, gathered whole at their forward (and backward) with no hooks below them.

A module's granularity is DeepSpeed's: the parameters of its subtree divided by the number of modules in
it that count (torch leaf modules with parameters, plus each non-container module on the way, itself
included). Torch leaf modules and containers (ModuleList, Sequential, ...) never become leaves, nor does
a subtree of more than 1e9 parameters (its gather would hold too much at once). Walking from the root,
the first module at or below the threshold on each path is flagged and its subtree is not descended:
the coarsest qualifying module wins. Fewer, larger units mean fewer collectives and hooks per step
(host time) for the same bytes."""
from __future__ import annotations

import logging
import sys

import torch

from deepspeed_c.utils.z3_leaf_module import set_z3_leaf_module

logger = logging.getLogger(__name__)

MAX_LEAF_NUMEL = int(1e9)
CONTAINERS = tuple(getattr(torch.nn, n) for n in ("Sequential", "ModuleList", "ModuleDict", "ParameterList",
                                                    "ParameterDict", "Container") if hasattr(torch.nn, n))


def param_numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())


def granularities(module: torch.nn.Module) -> dict[int, int]:
    """id(module) -> granularity (sys.maxsize where a module can never be a leaf)."""
    out: dict[int, int] = {}

    def walk(m: torch.nn.Module) -> tuple[int, int]:  # (counted modules, parameters) of m's subtree
        if not any(True for _ in m.parameters()):
            out[id(m)] = sys.maxsize
            return 0, 0
        params = sum(param_numel(p) for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            out[id(m)] = sys.maxsize
            return 1, params
        layers = 0
        for c in children:
            n, q = walk(c)
            layers, params = layers + n, params + q
        if isinstance(m, CONTAINERS):
            out[id(m)] = sys.maxsize
            return layers, params
        layers += 1
        out[id(m)] = params // layers if params <= MAX_LEAF_NUMEL else sys.maxsize
        return layers, params

    walk(module)
    return out


def mark_leaves_by_granularity(module: torch.nn.Module, threshold: int) -> list[torch.nn.Module]:
    """Flags the coarsest modules whose granularity is at most `threshold` as ZeRO-3 leaves; returns them."""
    if threshold is None or int(threshold) <= 0:
        return []
    threshold = int(threshold)
    gran = granularities(module)
    finite = [g for g in gran.values() if g != sys.maxsize]
    if not finite or min(finite) > threshold:
        logger.warning(f"stage3_module_granularity_threshold={threshold} flags no module: the finest module "
                       f"granularity is {min(finite) if finite else 'undefined (no eligible module)'}")
        return []
    leaves: list[torch.nn.Module] = []

    def descend(m: torch.nn.Module) -> None:
        if not any(True for _ in m.parameters()):
            return
        if gran.get(id(m), sys.maxsize) <= threshold:
            set_z3_leaf_module(m, True)
            leaves.append(m)
            return
        for c in m.children():
            descend(c)

    descend(module)
    logger.info(f"stage3_module_granularity_threshold={threshold}: {len(leaves)} leaf module(s) "
                f"({', '.join(sorted({type(m).__name__ for m in leaves}))})")
    return leaves
