"""deepspeed.utils.groups: the process groups DeepSpeed's code and users query.

Until tensor, sequence and expert parallelism land there is one kind of group: data parallel over
the whole world (model, tensor and sequence parallel worlds are of size 1). The expert-parallel
entry points raise NotImplementedError naming MoE instead of answering for groups that do not
exist."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    if ep_size != 1 or mpu is not None:
        raise NotImplementedError("deepspeed_c.utils.groups.initialize(ep_size > 1 or mpu=...): expert and model "
                                  "parallel groups are not built yet (MoE / tensor parallel issues)")


def get_data_parallel_group() -> Any:
    return dist.group.WORLD if _initialized() else None


_get_data_parallel_group = get_data_parallel_group


def get_data_parallel_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


_get_data_parallel_world_size = get_data_parallel_world_size


def get_data_parallel_rank() -> int:
    return dist.get_rank() if _initialized() else 0


_get_data_parallel_rank = get_data_parallel_rank


def _get_data_parallel_group_ranks() -> list[int]:
    return list(range(get_data_parallel_world_size()))


def _get_broadcast_src_rank() -> int:
    return 0


def get_model_parallel_world_size() -> int:
    return 1


get_tensor_model_parallel_world_size = _get_model_parallel_world_size = get_model_parallel_world_size


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_rank = get_model_parallel_rank


def get_model_parallel_group() -> Any:
    return None


get_tensor_model_parallel_group = get_model_parallel_group


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> Any:
    return None


_get_sequence_data_parallel_world_size = get_data_parallel_world_size
_get_sequence_data_parallel_rank = get_data_parallel_rank
_get_sequence_data_parallel_group = get_data_parallel_group


def _expert_groups(*_: Any, **__: Any) -> Any:
    raise NotImplementedError("deepspeed_c.utils.groups: expert-parallel groups are not built yet (MoE issue)")


_create_expert_and_data_parallel = _get_expert_parallel_group = _get_expert_data_parallel_group = _expert_groups
_get_expert_parallel_world_size = _get_expert_parallel_rank = _get_expert_data_parallel_world_size = _expert_groups
_get_expert_data_parallel_rank = _get_max_expert_size = _expert_groups
