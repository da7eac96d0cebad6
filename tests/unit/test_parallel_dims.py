"""ParallelDims: the one topology object the engine builds from its mpu (runtime/parallel_dims.py)."""
import dataclasses

import pytest

from deepspeed_c.runtime.parallel_dims import ParallelDims


class DataOnlyMPU:
    def __init__(self, dp: int, mp: int = 1) -> None:
        self.dp, self.mp = dp, mp

    def get_data_parallel_group(self) -> str:
        return "dp-group"

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_model_parallel_world_size(self) -> int:
        return self.mp


class SequenceMPU(DataOnlyMPU):
    sequence_parallel_size = 2


class AutoTPMPU(DataOnlyMPU):
    autotp = True

    def get_model_parallel_group(self) -> str:
        return "tp-group"


def test_no_mpu_is_plain_data_parallel_over_the_world():
    assert ParallelDims.from_mpu(None, world_size=4, config_world_size=99) == ParallelDims(data=4)


def test_data_size_is_the_configs_unless_sequence_parallel():
    dims = ParallelDims.from_mpu(DataOnlyMPU(dp=8), world_size=8, config_world_size=2)
    assert (dims.data, dims.sequence, dims.tensor, dims.autotp, dims.data_group) == (2, 1, 1, False, "dp-group")
    sp = ParallelDims.from_mpu(SequenceMPU(dp=4), world_size=4, config_world_size=2)
    assert (sp.data, sp.sequence) == (4, 2)  # reductions span data x sequence ranks


def test_autotp_reads_its_tensor_size_and_group():
    dims = ParallelDims.from_mpu(AutoTPMPU(dp=2, mp=2), world_size=4, config_world_size=2)
    assert dims.autotp and dims.tensor == 2 and dims.tensor_parallel and dims.tensor_group == "tp-group"
    one = ParallelDims.from_mpu(AutoTPMPU(dp=4, mp=1), world_size=4, config_world_size=4)
    assert one.autotp and not one.tensor_parallel


def test_model_parallel_mpu_missing_a_protocol_method_is_named():
    # a model-parallel size above 1 is read through DeepSpeed's mpu protocol, which this mpu lacks in part
    with pytest.raises(TypeError, match=r"get_model_parallel_rank.*get_model_parallel_group.*get_data_parallel_rank"):
        ParallelDims.from_mpu(DataOnlyMPU(dp=2, mp=2), world_size=4, config_world_size=2)


class MegatronMPU(DataOnlyMPU):
    """Single-process: the group checks need torch.distributed and are skipped by read_mpu without it."""

    def __init__(self, dp: int, tp: int, rank: int) -> None:
        super().__init__(dp, tp)
        self.rank = rank

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.mp

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.mp

    def get_model_parallel_group(self) -> str:
        return "mp-group"

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.mp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank % self.mp

    def get_tensor_model_parallel_group(self) -> str:
        return "tp-group"


def test_megatron_mpu_reads_tensor_and_model_axes():
    dims = ParallelDims.from_mpu(MegatronMPU(dp=2, tp=2, rank=3), world_size=4, config_world_size=2)
    assert (dims.data, dims.tensor, dims.model, dims.model_rank, dims.tensor_rank) == (2, 2, 2, 1, 1)
    assert dims.tensor_parallel and not dims.autotp and not dims.autotp_sharded
    assert (dims.data_group, dims.tensor_group) == ("dp-group", "tp-group")


def test_megatron_mpu_sizes_must_cover_the_world():
    with pytest.raises(ValueError, match=r"data-parallel size 2 x model-parallel size 2 = 4, but the world size is 8"):
        ParallelDims.from_mpu(MegatronMPU(dp=2, tp=2, rank=0), world_size=8, config_world_size=2)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelDims(data=2).data = 4
