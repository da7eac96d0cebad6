"""How the ranks split the work, read once from the model-parallel unit (mpu) the engine was given.

An mpu is duck-typed (Megatron's, DeepSpeed's Ulysses one, AutoTP's own, the pipeline's data-parallel view,
a user's), so what it offers has to be probed; that probing happens here, once, and everything downstream
reads the fields of one frozen object instead of asking the mpu again (`getattr(mpu, "autotp")` at each site).
torchtitan's ParallelDims is the model. The pipeline's stages and MoE's expert groups are not an mpu's to
tell: the PipelineEngine's grid and runtime/moe_reduction.py's ExpertParallelism hold those."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["ParallelDims"]

# where an mpu states its model-parallel size: Megatron's older and newer names
_MODEL_PARALLEL_GETTERS = ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    data: int                    # ranks the engine's reductions and ZeRO partitions span (its dp_world_size)
    sequence: int = 1            # Ulysses sequence-parallel ranks, counted inside `data`
    tensor: int = 1              # AutoTP's tensor-parallel ranks (1 otherwise: other model parallelism is refused)
    autotp: bool = False         # deepspeed_c sharded the model itself: norms and checkpoints handle the TP group
    data_group: Any = None       # the process group behind `data` (None: the whole world)
    tensor_group: Any = None     # AutoTP's tensor-parallel group

    @property
    def tensor_parallel(self) -> bool:
        """AutoTP shards the model over more than one rank."""
        return self.autotp and self.tensor > 1

    @classmethod
    def from_mpu(cls, mpu: Optional[Any], world_size: int, config_world_size: int) -> "ParallelDims":
        """`world_size` is torch.distributed's; `config_world_size` the config's data-parallel world (world
        // sequence_parallel_size, or the mpu's data-parallel size). Raises NotImplementedError for an mpu
        that splits the model across ranks other than AutoTP's."""
        if mpu is None:
            return cls(data=world_size)
        # Ulysses: reductions and ZeRO partitions span data x sequence ranks (the view's "data-parallel"
        # group); batch arithmetic keeps the config's world // sequence_parallel_size
        sequence = int(getattr(mpu, "sequence_parallel_size", 1))
        data = mpu.get_data_parallel_world_size() if sequence > 1 else config_world_size
        autotp = bool(getattr(mpu, "autotp", False))
        if not autotp:
            _refuse_model_parallel(mpu)
        data_group = mpu.get_data_parallel_group()
        if not autotp:
            return cls(data=data, sequence=sequence, data_group=data_group)
        return cls(data=data, sequence=sequence, tensor=int(mpu.get_model_parallel_world_size()), autotp=True,
                   data_group=data_group, tensor_group=mpu.get_model_parallel_group())


def _refuse_model_parallel(mpu: Any) -> None:
    """Until tensor parallelism beyond AutoTP lands, an mpu that splits the model across ranks is refused:
    norms, overflow checks and checkpoint names (mp_rank_XX) would ignore the model-parallel group."""
    for getter in _MODEL_PARALLEL_GETTERS:
        size = getattr(mpu, getter, None)
        if callable(size) and int(size()) > 1:
            raise NotImplementedError(
                f"deepspeed_c: initialize(mpu=...) with a model-parallel world size of {int(size())} "
                f"(mpu.{getter}()) is not supported yet: gradient norms, overflow checks and checkpoints "
                "(mp_rank_XX files) would cover only the data-parallel group. Tensor parallelism is a "
                "separate issue; an mpu with model-parallel size 1 works.")
