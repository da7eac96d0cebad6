"""`deepspeed.utils.comms_logging`: DeepSpeed's import path for the comms logger.

The logger itself lives in deepspeed_c.comm.comms_logging; this module gives scripts that import
it from DeepSpeed's location the same class, plus the module-level helpers with DeepSpeed's
signatures (calc_bw_log takes no world size: it reads the process group's, as DeepSpeed does).
"""
from __future__ import annotations

import sys

from deepspeed_c.comm.comms_logging import CommsLogger, convert_size
from deepspeed_c.comm.comms_logging import calc_bw_log as _calc_bw_log_n

__all__ = ["CommsLogger", "calc_bw_log", "convert_size", "get_caller_func", "print_rank_0"]


def get_caller_func(frame: int = 3) -> str:
    """Name of the function `frame` levels up the call stack."""
    return sys._getframe(frame).f_code.co_name


def print_rank_0(message: str) -> None:
    import deepspeed_c.comm as dist

    if dist.get_rank() == 0:
        print(message)


def calc_bw_log(comm_op: str, size: float, duration: float) -> tuple[float, float]:
    """(algbw, busbw) in Gbps of one `comm_op` moving `size` bytes in `duration` ms over the
    current world (1 rank when no process group is up)."""
    import torch.distributed as tdist

    n = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
    return _calc_bw_log_n(comm_op, size, duration, n)
