"""How the ranks split the work, read once from the model-parallel unit (mpu) the engine was given.

An mpu is duck-typed (Megatron's, DeepSpeed's Ulysses one, AutoTP's own, the pipeline's data-parallel view,
a user's), so what it offers has to be probed; that probing happens here, once, and everything downstream
reads the fields of one frozen object instead of asking the mpu again (`getattr(mpu, "autotp")` at each site).
torchtitan's ParallelDims is the model. The pipeline's stages and MoE's expert groups are not an mpu's to
tell: the PipelineEngine's grid and runtime/moe_reduction.py's ExpertParallelism hold those."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from deepspeed_c.runtime.model_parallel.mpu_protocol import read_mpu, tensor_parallel_size

__all__ = ["ParallelDims"]


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    data: int                    # ranks the engine's reductions and ZeRO partitions span (its dp_world_size)
    sequence: int = 1            # Ulysses sequence-parallel ranks, counted inside `data`
    tensor: int = 1              # tensor-parallel ranks (AutoTP's, or the client's Megatron-style layers')
    autotp: bool = False         # deepspeed_c sharded the model itself: checkpoints hold the unsharded model
    data_group: Any = None       # the process group behind `data` (None: the whole world)
    tensor_group: Any = None     # the tensor-parallel group the gradient norm sums shards over
    model: int = 1               # DeepSpeed's model-parallel size: mp_rank_XX checkpoint files (client mpu only)
    model_rank: int = 0          # this rank's XX in mp_rank_XX
    tensor_rank: int = 0         # this rank's place in tensor_group

    @property
    def tensor_parallel(self) -> bool:
        """The model is split over more than one tensor-parallel rank (AutoTP's or the client's): norms and
        overflow checks sum over `tensor_group`."""
        return self.tensor > 1

    @property
    def autotp_sharded(self) -> bool:
        """AutoTP shards the model over more than one rank (its checkpoints are gathered whole)."""
        return self.autotp and self.tensor > 1

    @classmethod
    def from_mpu(cls, mpu: Optional[Any], world_size: int, config_world_size: int, rank: int = 0) -> "ParallelDims":
        """`world_size` is torch.distributed's; `config_world_size` the config's data-parallel world (world
        // sequence_parallel_size, or the mpu's data-parallel size). A client mpu that splits the model is
        read and checked against the world through the mpu protocol (collective: every rank calls it)."""
        if mpu is None:
            return cls(data=world_size)
        # Ulysses: reductions and ZeRO partitions span data x sequence ranks (the view's "data-parallel"
        # group); batch arithmetic keeps the config's world // sequence_parallel_size
        sequence = int(getattr(mpu, "sequence_parallel_size", 1))
        autotp = bool(getattr(mpu, "autotp", False))
        if not autotp and tensor_parallel_size(mpu) > 1:
            return cls._from_model_parallel(mpu, world_size, rank, sequence)
        # AutoTP: the config's world is every rank (DeepSpeed's batch arithmetic), the mpu's is data parallel
        data = mpu.get_data_parallel_world_size() if sequence > 1 or autotp else config_world_size
        data_group = mpu.get_data_parallel_group()
        if not autotp:
            return cls(data=data, sequence=sequence, data_group=data_group)
        return cls(data=data, sequence=sequence, tensor=int(mpu.get_model_parallel_world_size()), autotp=True,
                   data_group=data_group, tensor_group=mpu.get_model_parallel_group())

    @classmethod
    def _from_model_parallel(cls, mpu: Any, world_size: int, rank: int, sequence: int) -> "ParallelDims":
        reading = read_mpu(mpu, world_size, rank)
        if sequence > 1 or reading.sequence > 1:
            raise NotImplementedError("initialize(mpu=...): sequence parallelism together with tensor parallelism "
                                      f"(tensor-parallel size {reading.tensor}) is not built; use one of them")
        if reading.model != reading.tensor:
            raise NotImplementedError(
                f"initialize(mpu=...): the mpu's model-parallel size ({reading.model}) spans more than its tensor-"
                f"parallel size ({reading.tensor}): pipeline stages belong to a PipelineModule (its topology's "
                "'pipe' axis), not to the engine's mpu; pass the mpu of tensor x data only")
        return cls(data=reading.data, tensor=reading.tensor, data_group=reading.data_group,
                   tensor_group=reading.tensor_group, model=reading.model, model_rank=reading.model_rank,
                   tensor_rank=reading.tensor_rank)
