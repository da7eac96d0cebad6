"""The engine's CPU path for clipping and fp16 unscale: one C call over a whole tensor list
(float32/bfloat16/float16, contiguous host tensors)."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch


@functools.lru_cache(maxsize=None)
def _op():
    # load() hashes the sources to find the cached build; once per process is enough
    from deepspeed_c.ops.op_builder import CPUMultiTensorBuilder

    return CPUMultiTensorBuilder().load()


def global_l2_norm(tensors: Sequence[torch.Tensor]) -> tuple[float, bool]:
    """(L2 norm of all elements together, whether any element is inf or nan)."""
    sumsq, found = _op().sumsq([t.detach() for t in tensors])
    return math.sqrt(sumsq) if sumsq == sumsq else float("nan"), bool(found)


def multi_tensor_global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The norm as a float32 0-dim tensor (inf or nan when an element is), as torch's norms."""
    norm, _ = global_l2_norm(tensors)
    return torch.tensor(norm, dtype=torch.float32)


def scale_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """x *= factor in place for every tensor."""
    _op().scale_([t.detach() for t in tensors], float(factor))
