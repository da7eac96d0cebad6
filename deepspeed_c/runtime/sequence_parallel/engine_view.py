"""What the engine sees of a Ulysses sequence-parallel mpu, and where such an mpu comes from.

DeepSpeed runs gradient reduction, ZeRO partitions and broadcasts over the sequence-data-parallel
group (every rank holding a replica of the parameters, i.e. data x sequence ranks), and divides the
summed gradients by the data-parallel size only (world / sp): the ranks of one sequence-parallel
group hold partial gradients of the same samples, which add up, while data-parallel replicas are
averaged. Batch arithmetic (train_batch_size = micro x accumulation x dp) counts world / sp ranks.
`SequenceDataParallelView` gives the engine exactly that (ZeRO 1, 2 and 3 partition over it too): its
"data-parallel" group is the sequence-data-parallel one, and `sequence_parallel_size` tells the
reducers the divisor's factor.

Sources of the mpu, as DeepSpeed's initialize has them: `initialize(mpu=...)` with a
sequence-parallel mpu (register_with_transformers's, or any object with
get_sequence_parallel_group and get_sequence_data_parallel_group), `initialize(mesh_param=(dp, sp))`,
or the config's `data_parallel_size` and `sequence_parallel_size` together. The config's
`sequence_parallel_size` alone changes only batch arithmetic (no groups are built, gradients are
averaged over every rank) -- also as in DeepSpeed.
"""
from __future__ import annotations

from typing import Any, Optional


def is_sequence_parallel_mpu(mpu: Any) -> bool:
    """DeepSpeed's test: a sequence-parallel mpu has sequence groups and no data-parallel world size."""
    return (mpu is not None and hasattr(mpu, "get_sequence_parallel_group")
            and hasattr(mpu, "get_sequence_data_parallel_group") and not hasattr(mpu, "get_data_parallel_world_size"))


class SequenceDataParallelView:
    """The engine's mpu under Ulysses: reductions and partitions over the data x sequence ranks."""

    def __init__(self, sp_mpu: Any) -> None:
        self.sp_mpu = sp_mpu
        self.sequence_parallel_size = int(sp_mpu.get_sequence_parallel_world_size())

    def get_data_parallel_group(self) -> Any:
        return self.sp_mpu.get_sequence_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return int(self.sp_mpu.get_sequence_data_parallel_world_size())

    def get_data_parallel_rank(self) -> int:
        return int(self.sp_mpu.get_sequence_data_parallel_rank())

    def get_model_parallel_world_size(self) -> int:
        return 1  # parameters are whole on every rank: checkpoints are mp_rank_00, norms are local

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_group(self) -> Any:
        return self.sp_mpu.get_sequence_parallel_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence_parallel_size

    def get_sequence_parallel_rank(self) -> int:
        return int(self.sp_mpu.get_sequence_parallel_rank())

    def get_sequence_data_parallel_group(self) -> Any:
        return self.get_data_parallel_group()


def _autosp_shape(sp: Any) -> tuple:
    """AutoSP (compile.passes ["autosp"]) takes sequence_parallel_size alone, DeepSpeed's way: the data-parallel
    size is what is left of the world."""
    import torch.distributed as tdist

    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if not isinstance(sp, int) or sp < 1 or world % sp != 0:
        raise ValueError(f"config key 'sequence_parallel_size' {sp!r} must be a positive int dividing the world "
                         f"size {world} (AutoSP: compile.passes ['autosp'])")
    return (world // sp, sp)


def sequence_parallel_mpu(config: dict, mpu: Any, mesh_param: Any) -> Optional[Any]:
    """The sequence-parallel mpu initialize should use, building its groups from mesh_param or the
    config's data_parallel_size x sequence_parallel_size when no mpu was given; None if none applies."""
    if mpu is not None:
        if mesh_param:
            raise ValueError("deepspeed.initialize: give either mpu or mesh_param, not both")
        return mpu if is_sequence_parallel_mpu(mpu) else None
    shape = None
    if mesh_param:
        shape, source = tuple(mesh_param), "mesh_param"
    elif "sequence_parallel_size" in config and "data_parallel_size" in config:
        shape, source = (config["data_parallel_size"], config["sequence_parallel_size"]), \
            "data_parallel_size x sequence_parallel_size"
    elif "sequence_parallel_size" in config and "autosp" in ((config.get("compile") or {}).get("passes") or []):
        shape, source = _autosp_shape(config["sequence_parallel_size"]), "sequence_parallel_size (AutoSP)"
    if shape is None:
        return None
    import torch.distributed as tdist

    if len(shape) != 2 or not all(isinstance(v, int) and v >= 1 for v in shape):
        raise ValueError(f"{source} must be two positive ints (data_parallel, sequence_parallel), got {shape!r}")
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if shape[0] * shape[1] != world:
        raise ValueError(f"{source} = {shape[0]} x {shape[1]} does not equal the world size {world}")
    if "sequence_parallel_size" in config and config["sequence_parallel_size"] != shape[1]:
        raise ValueError(f"mesh_param's sequence-parallel size {shape[1]} differs from the config's "
                         f"sequence_parallel_size {config['sequence_parallel_size']}")
    if shape[1] == 1:
        return None
    from deepspeed_c.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(shape[1])  # (dp, sp) mesh: sp is the inner, consecutive axis
    return parallel_state_sp
