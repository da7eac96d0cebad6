"""The arithmetic shared by the curriculum and random-LTD schedules: a root-shaped ramp from a minimum
to a maximum, floored to a multiple of a step. The float operations run in DeepSpeed's order so every
value is bit-for-bit DeepSpeed's (a reordered product can floor one step lower near a multiple)."""
from __future__ import annotations

import math


def root_ramp(global_steps: int, total_steps: int, root_degree: float, lo: int, hi: int, step: int) -> int:
    """lo + (hi - lo) * (global_steps / total_steps) ** (1 / root_degree), floored, then rounded down to a
    multiple of `step` (not capped: callers cap at hi)."""
    frac = (float(global_steps) / total_steps) ** (1.0 / root_degree)
    value = math.floor(frac * (hi - lo) + lo)
    return value - value % step


def first_multiple_at_or_above(value: int, step: int) -> int:
    return -(-value // step) * step
