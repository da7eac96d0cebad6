"""ZeRO-3 units chosen automatically: where `stage3_module_granularity_threshold` is not set, the coarsest
modules that are safe and small enough become *unit roots*, each gathered (and reduce-scattered) as one
unit with its forward and backward hooks on the root only, as FSDP2 wraps a transformer block.

Why: with DeepSpeed's default JSON every leaf module (each LayerNorm, each Linear) is its own unit, and
each unit costs the host a fixed price a step (two hooks, two autograd identity nodes, a collective
launch, a reduce-scatter bucket) that does not shrink with its size. A gather of n elements costs about
alpha + beta n; below a few million elements alpha dominates, so a GPT block of six leaves gathered
once costs about a sixth of the host time for the same bytes (measured on 4 H100s at 1.3B: forward
89 -> 51 ms, benchmarks/RESULTS.md).

The choice, walking from the root (never a unit itself: it is the whole iteration) and stopping at the
first module on each path that qualifies:

- not a container (ModuleList, Sequential, ...: they never run as a whole) nor a module without a
  forward of its own (a holder whose children its parent calls one by one);
- at least two modules with parameters below it, itself included (a single torch leaf is a unit already);
- its parameters, counted once, at most `cap` elements: half of stage3_max_live_parameters (a unit and
  the next one prefetched fit under the limit), and at most half of the model (a wrapper of nearly the
  whole model is descended: units must be several for gathers to overlap compute); with parameters on
  NVMe, at most offload_param.buffer_size x world size (a rank's share is read into one swap-in buffer);
- self-contained: no parameter of its subtree held by a module outside it (a tied embedding), no module
  of its subtree also registered outside it, no expert (MoE) parameter (partitioned over another group);
- not under a user's leaf module (zero_optimization.leaf_module, set_z3_leaf_modules): that is a unit.

The prefetch window of the fetch plan is at least one unit deep (a unit above stage3_prefetch_bucket_size
is still prefetched alone, as DeepSpeed's prefetcher always admits the first parameter). What coarse
units change, and how the coordinator (param_hooks.py) keeps it correct: a module of a unit called
outside its root's forward (by the root's parent, or directly) is a step of the root, which gathers the
whole unit for the call and its backward (one forward pre-hook per such module, a list lookup inside the
root's forward); a parameter of a unit read through its attribute inside another module's forward is
gathered on access; a unit's parameters are all live during its forward and backward (bounded by `cap`);
GatheredParameters gathers whole units.

DSC_Z3_AUTO_UNITS=0 turns the choice off (per-leaf units, for A/B runs); DeepSpeed has no key for it."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from deepspeed_c.runtime.zero.leaf_granularity import CONTAINERS, param_numel

logger = logging.getLogger(__name__)

ENV = "DSC_Z3_AUTO_UNITS"


def enabled() -> bool:
    """Whether units are chosen automatically (DSC_Z3_AUTO_UNITS unset, or anything but 0/false/off)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def unit_cap(total_numel: int, max_live_parameters: int) -> int:
    """The largest unit (elements) the choice makes."""
    return max(0, min(int(max_live_parameters) // 2, int(total_numel) // 2))


def _has_forward(m: torch.nn.Module) -> bool:
    return getattr(type(m).forward, "__name__", "") != "_forward_unimplemented"


def _is_expert(p: torch.nn.Parameter) -> bool:
    return getattr(p, "allreduce", True) is False  # DeepSpeed's mark of an MoE expert parameter


class _Tree:
    """The module tree with sharing made explicit: parents of each module object, holders of each parameter,
    subtree members and parameters (each counted once)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.parents: dict[int, set[int]] = {}
        self.holders: dict[int, set[int]] = {}
        for _, m in root.named_modules(remove_duplicate=False):
            for c in m.children():
                self.parents.setdefault(id(c), set()).add(id(m))
            for p in m._parameters.values():
                if p is not None:
                    self.holders.setdefault(id(p), set()).add(id(m))

    def qualifies(self, m: torch.nn.Module, cap: int) -> bool:
        if isinstance(m, CONTAINERS) or not _has_forward(m):
            return False
        members = list(m.modules())
        ids = {id(c) for c in members}
        holders = sum(1 for c in members if any(p is not None for p in c._parameters.values()))
        if holders < 2:
            return False
        params = {id(p): p for p in m.parameters()}
        if not params or sum(param_numel(p) for p in params.values()) > cap:
            return False
        if any(_is_expert(p) for p in params.values()):
            return False
        if any(not self.holders.get(i, set()) <= ids for i in params):
            return False  # a parameter shared with a module outside (a tied embedding)
        return all(self.parents.get(id(c), set()) <= ids for c in members if c is not m)


def choose_unit_roots(module: torch.nn.Module, max_live_parameters: int, is_leaf: Optional[object] = None,
                      max_unit: Optional[int] = None) -> list[torch.nn.Module]:
    """The modules that become one ZeRO-3 unit each (see the module docstring); `is_leaf(m)` tells a user's
    leaf module, whose subtree is left alone; `max_unit` (elements) bounds a unit further (parameters on NVMe:
    a rank's share of a unit must fit one swap-in buffer)."""
    params = {id(p): p for p in module.parameters()}
    cap = unit_cap(sum(param_numel(p) for p in params.values()), max_live_parameters)
    if max_unit is not None:
        cap = min(cap, int(max_unit))
    tree = _Tree(module)
    roots: list[torch.nn.Module] = []
    seen: set[int] = set()

    def descend(m: torch.nn.Module, top: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if is_leaf is not None and is_leaf(m):  # type: ignore[operator]
            return
        if not top and tree.qualifies(m, cap):
            roots.append(m)
            return
        for c in m.children():
            descend(c, False)

    descend(module, True)
    if roots:
        kinds = sorted({type(m).__name__ for m in roots})
        logger.info(f"ZeRO-3 units chosen automatically ({ENV}=0 turns this off): {len(roots)} module(s) gathered "
                    f"whole ({', '.join(kinds)}), at most {cap} elements each")
    return roots
