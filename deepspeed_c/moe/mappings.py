"""deepspeed.moe.mappings: token dropping/gathering across tensor-parallel ranks. deepspeed_c has no
tensor parallelism yet, so the tensor-parallel world is one rank and both are the identity (as
DeepSpeed's are at that size)."""
from __future__ import annotations

import torch

from deepspeed_c.utils import groups


def _tp_world() -> int:
    return groups.get_tensor_model_parallel_world_size()


def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    if _tp_world() == 1:
        return input_
    raise NotImplementedError("deepspeed_c.moe.mappings.gather_tokens: tensor parallelism is not built yet")


def drop_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    if _tp_world() == 1:
        return input_
    raise NotImplementedError("deepspeed_c.moe.mappings.drop_tokens: tensor parallelism is not built yet")
