"""Rank and size as the launcher (ours, torchrun, or Open MPI's mpirun) states them in the
environment, before or without a process group."""
from __future__ import annotations

import os
import sys


def _first_env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value != "":
            return value
    return None


def get_local_rank_from_launcher() -> int:
    value = _first_env("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    return int(value) if value is not None else 0


def get_world_rank_from_launcher() -> int:
    value = _first_env("RANK", "OMPI_COMM_WORLD_RANK")
    return int(value) if value is not None else 0


def get_world_size_from_launcher() -> int:
    value = _first_env("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    return int(value) if value is not None else 1


def get_caller_func(frame: int = 3) -> str:
    """Name of the function `frame` levels up the stack (for the comms logger's debug names)."""
    try:
        return sys._getframe(frame).f_code.co_name
    except ValueError:  # stack shallower than asked
        return "<unknown>"
