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


def test_other_model_parallelism_is_refused_naming_the_getter():
    with pytest.raises(NotImplementedError, match=r"model-parallel world size of 2 \(mpu.get_model_parallel_world_size"):
        ParallelDims.from_mpu(DataOnlyMPU(dp=2, mp=2), world_size=4, config_world_size=2)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelDims(data=2).data = 4
