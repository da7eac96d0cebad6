"""deepspeed_c.comm's common path for bucket collectives: the call prebuilt once per (group, op, async_op).

ZeRO issues one reduce-scatter per gradient bucket, once per unit in a ZeRO-3 backward, and ZeRO-3 one
all-gather per parameter fetch (several units' fetch as one coalesced collective). Through the
general path that is the backend's AVG and fallback bookkeeping (closures, a backend-name lookup per
call) and torch.distributed's front (its logger decorators, argument checks, group lookup, fresh
options): more host time than enqueuing the collective. All of that depends only on the group and the
op, so it is resolved on the first call into a `Prebuilt` (the process group, its world size, the
options, the names its fallbacks are recorded under); later calls check a few attributes and call the
process group's own method, the one torch.distributed's function ends in, looked up on the group as torch does.

An entry belongs to the world it was made in: when the default group is replaced (destroyed and
initialised again) every entry is stale and the table is dropped at the next miss; it is also dropped
by destroy_process_group and at exit, so it never keeps a destroyed group (and gloo's threads) alive."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from deepspeed_c.comm.reduce_op import is_avg, to_torch_op

MISS = object()  # what a direct call returns where the general path must serve the call

_WORLD = dist.distributed_c10d._world if dist.is_available() else None
# torch's own function (a wrapper installed on torch.distributed later is not this) and the process
# group methods they end in (called on the group object, as torch does, so a wrapper installed on the
# ProcessGroup class, a collective counter, sees every call)
TORCH_REDUCE_SCATTER = getattr(dist.distributed_c10d, "reduce_scatter_tensor", None) if _WORLD else None
PG_REDUCE_SCATTER = getattr(dist.ProcessGroup, "_reduce_scatter_base", None) if _WORLD else None
TORCH_ALL_GATHER = getattr(dist.distributed_c10d, "all_gather_into_tensor", None) if _WORLD else None
PG_ALL_GATHER = getattr(dist.ProcessGroup, "_allgather_base", None) if _WORLD else None
# what torch's coalescing manager issues for a block of all_gather_into_tensor calls
PG_ALL_GATHER_COALESCED = getattr(dist.ProcessGroup, "allgather_into_tensor_coalesced", None) if _WORLD else None
_ALLGATHER_OPTIONS = getattr(dist.distributed_c10d, "AllgatherOptions", None) if _WORLD else None


class Prebuilt:
    """One (group, op, async_op): what a call needs, and which fallbacks would take it over."""

    __slots__ = ("group", "op", "async_op", "pg", "world", "world_size", "options", "op_names", "refused_keys")

    def __init__(self, group: Any, op: Any, async_op: bool, pg: Any, world: Any, world_size: int, options: Any,
                 op_names: tuple[str, ...], backend: str) -> None:
        # the call's arguments, for an identity test against the next call's (hashing a torch ReduceOp
        # for a table lookup costs a third of a microsecond, as much as all the other checks together)
        self.group, self.op, self.async_op = group, op, async_op
        self.pg = pg
        self.world = world  # the default group when this was built: the entry is valid while it stands
        self.world_size = world_size
        self.options = options
        self.op_names = op_names
        self.refused_keys = tuple((backend, name) for name in op_names)

    def fallback_due(self, forced: set[str], refused: set[tuple[str, str]]) -> bool:
        """Whether DSC_COMM_FALLBACK forces, or an earlier refusal chose, a fallback for this call."""
        return any(name in forced for name in self.op_names) or any(key in refused for key in self.refused_keys)


REDUCE_SCATTERS: dict[tuple[Any, Any, bool], Prebuilt] = {}  # (group, op, async_op) -> entry
ALL_GATHERS: dict[tuple[Any, bool], Prebuilt] = {}  # (group, async_op) -> entry


last_reduce_scatter: Optional[Prebuilt] = None  # the entry of the latest reduce-scatter call


def clear() -> None:
    global last_reduce_scatter
    REDUCE_SCATTERS.clear()
    ALL_GATHERS.clear()
    last_reduce_scatter = None


def _world_now() -> Any:
    """The default group, after dropping every entry made in a world that no longer stands."""
    world = _WORLD._default_pg
    if any(e.world is not world for e in REDUCE_SCATTERS.values()) or any(
            e.world is not world for e in ALL_GATHERS.values()):
        clear()
    return world


def find_reduce_scatter(group: Any, op: Any, async_op: bool) -> Optional[Prebuilt]:
    """The entry for (group, op, async_op), made if new, kept as the latest; None as prebuild_reduce_scatter."""
    global last_reduce_scatter
    try:
        entry = REDUCE_SCATTERS.get((group, op, async_op))
    except TypeError:  # an unhashable argument: the general path
        return None
    if entry is None or entry.world is not _WORLD._default_pg:
        entry = prebuild_reduce_scatter(group, op, async_op)
    last_reduce_scatter = entry
    return entry


def prebuild_reduce_scatter(group: Any, op: Any, async_op: bool) -> Optional[Prebuilt]:
    """The entry for a reduce_scatter_tensor on `group` with `op`, or None where only the general path
    can serve it (no group up, not a process group this rank belongs to, an op torch would refuse)."""
    if _WORLD is None or PG_REDUCE_SCATTER is None or TORCH_REDUCE_SCATTER is None:
        return None
    world = _world_now()
    if world is None:
        return None
    pg = group if group is not None else world
    if not isinstance(pg, dist.ProcessGroup) or not isinstance(async_op, bool):
        return None
    try:
        torch_op = to_torch_op(op)
        options = dist.ReduceScatterOptions()
        options.reduceOp = torch_op
        if hasattr(options, "asyncOp"):
            options.asyncOp = async_op
        backend = str(dist.get_backend(group))  # TorchBackend.get_backend's key for its refusals
        world_size = dist.get_world_size(group)
        key = (group, op, async_op)
        hash(key)
    except (ValueError, TypeError, RuntimeError):
        return None
    names = ("reduce_scatter_tensor", "avg") if is_avg(torch_op) else ("reduce_scatter_tensor",)
    entry = REDUCE_SCATTERS[key] = Prebuilt(group, op, async_op, pg, world, world_size, options, names, backend)
    return entry


def prebuild_all_gather(group: Any, async_op: bool) -> Optional[Prebuilt]:
    """The entry for all_gather_into_tensor (and its coalesced form) on `group`, or None as above."""
    if _WORLD is None or PG_ALL_GATHER is None or TORCH_ALL_GATHER is None or _ALLGATHER_OPTIONS is None:
        return None
    world = _world_now()
    if world is None:
        return None
    pg = group if group is not None else world
    if not isinstance(pg, dist.ProcessGroup) or not isinstance(async_op, bool):
        return None
    try:
        options = _ALLGATHER_OPTIONS()
        if hasattr(options, "asyncOp"):
            options.asyncOp = async_op
        backend = str(dist.get_backend(group))
        world_size = dist.get_world_size(group)
        key = (group, async_op)
        hash(key)
    except (ValueError, TypeError, RuntimeError):
        return None
    entry = ALL_GATHERS[key] = Prebuilt(group, None, async_op, pg, world, world_size, options,
                                          ("all_gather_into_tensor",), backend)
    return entry
