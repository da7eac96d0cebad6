"""deepspeed.comm.ReduceOp: DeepSpeed's own enum, accepted next to torch's ReduceOp."""
from __future__ import annotations

from enum import Enum
from typing import Any


class ReduceOp(Enum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def to_torch_op(op: Any) -> Any:
    """Map a deepspeed_c ReduceOp (or a torch one, returned unchanged) to torch's ReduceOp."""
    import torch.distributed as dist

    if isinstance(op, ReduceOp):
        if op is ReduceOp.UNUSED:
            raise ValueError("ReduceOp.UNUSED is not a reduction; pass SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR or AVG")
        return getattr(dist.ReduceOp, op.name)
    return op


def is_avg(op: Any) -> bool:
    import torch.distributed as dist

    return to_torch_op(op) == dist.ReduceOp.AVG
