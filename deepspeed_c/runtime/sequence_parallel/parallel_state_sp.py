"""deepspeed.runtime.sequence_parallel.parallel_state_sp: the mpu of Ulysses sequence parallelism.

Two axes only: sequence parallel groups of `sequence_parallel_size` consecutive ranks (rank r is in
group r // sp), and the data parallel axis across them. Parameters are replicated on every rank,
so gradients and ZeRO partitions span the sequence-data-parallel group, which with these two axes
is the whole world. The module itself is the mpu DeepSpeed hands out (register_with_transformers
returns it); like DeepSpeed's it has no get_data_parallel_world_size, which is how the config and
the engine recognise a sequence-parallel mpu (batch arithmetic then uses world // sp ranks)."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

_SEQUENCE_PARALLEL_GROUP: Any = None
_SEQUENCE_PARALLEL_RANKS: Optional[list[int]] = None
_SEQUENCE_DATA_PARALLEL_GROUP: Any = None
_SEQUENCE_DATA_PARALLEL_RANKS: Optional[list[int]] = None


def sequence_parallel_layout(world_size: int, sequence_parallel_size: int) -> list[list[int]]:
    """The sequence-parallel groups as rank lists (pure arithmetic, checked)."""
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world_size < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world_size}) is less than sequence_parallel_size {sequence_parallel_size}")
    if world_size % sequence_parallel_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by sequence_parallel_size "
                           f"{sequence_parallel_size}")
    return [list(range(i, i + sequence_parallel_size)) for i in range(0, world_size, sequence_parallel_size)]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Creates the groups (every rank must call it, once per process group lifetime)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_PARALLEL_RANKS, _SEQUENCE_DATA_PARALLEL_GROUP
    global _SEQUENCE_DATA_PARALLEL_RANKS
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sequence parallel groups need torch.distributed initialized (deepspeed.init_distributed())")
    if _SEQUENCE_PARALLEL_GROUP is not None:
        if len(_SEQUENCE_PARALLEL_RANKS or []) == sequence_parallel_size:
            return  # the same layout again (a second register_with_transformers call): nothing to build
        raise AssertionError(f"sequence parallel group is already initialized with size "
                             f"{len(_SEQUENCE_PARALLEL_RANKS or [])}, cannot rebuild it with size "
                             f"{sequence_parallel_size} in the same process")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = sequence_parallel_layout(world, sequence_parallel_size)
    for ranks in layout:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_PARALLEL_RANKS = group, ranks
    # data x sequence: with no other axis it is every rank (a separate group object, as DeepSpeed makes)
    _SEQUENCE_DATA_PARALLEL_RANKS = list(range(world))
    _SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(_SEQUENCE_DATA_PARALLEL_RANKS)


def is_initialized() -> bool:
    return _SEQUENCE_PARALLEL_GROUP is not None


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (tests that tear torch.distributed down and bring it up again in one process)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_PARALLEL_RANKS, _SEQUENCE_DATA_PARALLEL_GROUP
    global _SEQUENCE_DATA_PARALLEL_RANKS
    _SEQUENCE_PARALLEL_GROUP = _SEQUENCE_PARALLEL_RANKS = None
    _SEQUENCE_DATA_PARALLEL_GROUP = _SEQUENCE_DATA_PARALLEL_RANKS = None


def get_sequence_parallel_group() -> Any:
    assert _SEQUENCE_PARALLEL_GROUP is not None, "sequence parallel group is not initialized"
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_data_parallel_group() -> Any:
    assert _SEQUENCE_DATA_PARALLEL_GROUP is not None, "sequence data parallel group is not initialized"
    return _SEQUENCE_DATA_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    return len(get_sequence_parallel_ranks())


def get_sequence_data_parallel_world_size() -> int:
    get_sequence_data_parallel_group()
    return len(_SEQUENCE_DATA_PARALLEL_RANKS or [])


def get_sequence_parallel_rank() -> int:
    return get_sequence_parallel_ranks().index(dist.get_rank())


def get_sequence_data_parallel_rank() -> int:
    get_sequence_data_parallel_group()
    return (_SEQUENCE_DATA_PARALLEL_RANKS or []).index(dist.get_rank())


def get_sequence_parallel_ranks() -> list[int]:
    """Global ranks of this rank's sequence-parallel group (a deepspeed_c addition)."""
    get_sequence_parallel_group()
    return list(_SEQUENCE_PARALLEL_RANKS or [])


# DeepSpeed aliases the model-parallel queries to the sequence axis (the only axis besides data)
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
