"""DeepSpeed's mpu protocol, read once.

DeepSpeed's engine calls `get_{model,data}_parallel_{rank,group,world_size}` on the mpu it is given;
Megatron's parallel_state adds `get_tensor_model_parallel_*` (the tensor-slicing axis alone, where
`get_model_parallel_*` may span pipeline x tensor) and `get_pipeline_model_parallel_*`. Which of those
an mpu has is probed here, once, into a frozen MPUReading; the engine's ParallelDims is built from it.
The checks DeepSpeed leaves to a hang or to silently wrong training raise here, at initialize: a
missing method (named), data-parallel groups that do not partition the world, data x model sizes
that do not multiply to the world size, and stated ranks that are not the ranks in the stated groups."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["REQUIRED_METHODS", "MPUReading", "read_mpu", "tensor_parallel_size"]

# what DeepSpeed's engine, ZeRO and checkpoints call on a model-parallel mpu
REQUIRED_METHODS = ("get_model_parallel_rank", "get_model_parallel_group", "get_model_parallel_world_size",
                    "get_data_parallel_rank", "get_data_parallel_group", "get_data_parallel_world_size")


@dataclasses.dataclass(frozen=True)
class MPUReading:
    """What a model-parallel mpu says about this rank. `model_*`: DeepSpeed's model-parallel axis (it
    names the mp_rank_XX checkpoint files; Megatron's spans pipeline x tensor); `tensor_*`: the
    tensor-slicing axis the gradient norm sums shards over (Megatron's get_tensor_model_parallel_*,
    else DeepSpeed's get_slice_parallel_*, else the model-parallel axis); `pipe`: Megatron's pipeline size."""
    data: int
    data_rank: int
    data_group: Any
    model: int
    model_rank: int
    model_group: Any
    tensor: int
    tensor_rank: int
    tensor_group: Any
    pipe: int = 1
    sequence: int = 1


def _call(mpu: Any, name: str) -> Any:
    fn = getattr(mpu, name, None)
    return fn() if callable(fn) else None


def _first(mpu: Any, names: tuple[str, ...]) -> Optional[str]:
    return next((n for n in names if callable(getattr(mpu, n, None))), None)


def tensor_parallel_size(mpu: Any) -> int:
    """The mpu's model-splitting size without any check (1 for a data-only mpu): Megatron's tensor size,
    else DeepSpeed's model-parallel size."""
    name = _first(mpu, ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"))
    return int(getattr(mpu, name)()) if name else 1


def read_mpu(mpu: Any, world_size: int, rank: int) -> MPUReading:
    """Reads a model-parallel mpu, checking it against the world (collective: every rank calls it)."""
    missing = [n for n in REQUIRED_METHODS if not callable(getattr(mpu, n, None))]
    if missing:
        raise TypeError(f"initialize(mpu=...): the mpu ({type(mpu).__name__}) has no method(s) {missing}; "
                        f"DeepSpeed's mpu protocol needs {list(REQUIRED_METHODS)} (Megatron's parallel_state "
                        "has them all)")
    t_size = _first(mpu, ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size"))
    t_rank = _first(mpu, ("get_tensor_model_parallel_rank", "get_slice_parallel_rank"))
    t_group = _first(mpu, ("get_tensor_model_parallel_group", "get_slice_parallel_group"))
    model = int(mpu.get_model_parallel_world_size())
    reading = MPUReading(
        data=int(mpu.get_data_parallel_world_size()), data_rank=int(mpu.get_data_parallel_rank()),
        data_group=mpu.get_data_parallel_group(), model=model, model_rank=int(mpu.get_model_parallel_rank()),
        model_group=mpu.get_model_parallel_group(),
        tensor=int(getattr(mpu, t_size)()) if t_size else model,
        tensor_rank=int(getattr(mpu, t_rank)()) if t_rank else int(mpu.get_model_parallel_rank()),
        tensor_group=getattr(mpu, t_group)() if t_group else mpu.get_model_parallel_group(),
        pipe=int(_call(mpu, "get_pipeline_model_parallel_world_size") or 1),
        sequence=int(_call(mpu, "get_sequence_parallel_world_size") or 1))
    try:
        _check_sizes(reading, world_size)
        _check_ranks(reading, world_size)
        problem = None
    except ValueError as e:  # raised on every rank below, so none is left waiting in the gather
        problem = str(e)
    _check_groups(reading, world_size, rank, problem)
    return reading


def _check_sizes(r: MPUReading, world_size: int) -> None:
    # the product first: it is the same on every rank, so every rank raises the same error
    if r.data * r.model * r.sequence != world_size:
        raise ValueError(f"initialize(mpu=...): data-parallel size {r.data} x model-parallel size {r.model}"
                         + (f" x sequence-parallel size {r.sequence}" if r.sequence > 1 else "")
                         + f" = {r.data * r.model * r.sequence}, but the world size is {world_size}; the mpu's "
                         "topology must cover every rank exactly once")
    if r.model % r.tensor:
        raise ValueError(f"initialize(mpu=...): the tensor-parallel size ({r.tensor}) does not divide the "
                         f"model-parallel size ({r.model})")
    for name, size, rank in (("data", r.data, r.data_rank), ("model", r.model, r.model_rank),
                             ("tensor_model", r.tensor, r.tensor_rank)):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"initialize(mpu=...): mpu.get_{name}_parallel_world_size() is {size} and "
                             f"mpu.get_{name}_parallel_rank() is {rank}; a rank must lie in [0, size)")


def _check_ranks(r: MPUReading, world_size: int) -> None:
    """The ranks the mpu states must be this process's ranks in the groups it returns: ZeRO shards by the
    group rank while the data loader and the zero_pp_rank_{D} / mp_rank_{XX} checkpoint names use the mpu's,
    so a mismatch would feed ranks the same samples or write two ranks' state to one file."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        return
    for name, group, stated in (("data", r.data_group, r.data_rank), ("tensor_model", r.tensor_group, r.tensor_rank)):
        actual = dist.get_rank() if group is None or group is dist.group.WORLD else dist.get_rank(group=group)
        if actual >= 0 and actual != stated:  # -1: not a member, which _check_groups names
            raise ValueError(f"initialize(mpu=...): mpu.get_{name}_parallel_rank() is {stated} on rank "
                             f"{dist.get_rank()}, but its rank in mpu.get_{name}_parallel_group() is {actual}")


def _group_ranks(group: Any, world_size: int) -> list[int]:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(world_size))
    return sorted(int(r) for r in dist.get_process_group_ranks(group))


def _check_groups(r: MPUReading, world_size: int, rank: int, problem: Optional[str]) -> None:
    """Every rank's data-parallel group and tensor-parallel group, gathered with any size problem a rank
    found (which every rank then raises): each axis's groups must partition the world (each rank in
    exactly one group, the group's members agreeing on it) and have the size the mpu states."""
    import torch.distributed as dist

    # the groups can only be compared across the ranks of the world the mpu describes
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        if problem:
            raise ValueError(problem)
        return
    mine = {"data": _group_ranks(r.data_group, world_size), "tensor": _group_ranks(r.tensor_group, world_size),
            "problem": problem}
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    found = next(((other, seen["problem"]) for other, seen in enumerate(every) if seen["problem"]), None)
    if found is not None:
        raise ValueError(found[1] if found[0] == rank else f"{found[1]} (on rank {found[0]})")
    for axis, size in (("data", r.data), ("tensor", r.tensor)):
        getter = f"mpu.get_{'data' if axis == 'data' else 'tensor_model'}_parallel_group()"
        for other, seen in enumerate(every):
            members = seen[axis]
            if other not in members:
                raise ValueError(f"initialize(mpu=...): {getter} on rank {other} is {members}, which does not "
                                 f"contain rank {other}")
            if len(members) != size:
                raise ValueError(f"initialize(mpu=...): {getter} on rank {other} has {len(members)} ranks "
                                 f"{members}, but the mpu's {axis}-parallel world size is {size}")
            for m in members:
                if every[m][axis] != members:
                    raise ValueError(f"initialize(mpu=...): the {axis}-parallel groups do not partition the world: "
                                     f"rank {other}'s group is {members} but rank {m}'s is {every[m][axis]}")
