"""Python handle on the C bucket planner (csrc/core/bucket_plan.c): layout once, then one cheap
`mark(param_index)` per gradient during backward."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


def _core():
    from deepspeed_c import _C

    return _C


@dataclass(frozen=True)
class BucketLayout:
    bucket_of: list[int]       # per param
    offset_of: list[int]       # per param, elements into its bucket's buffer
    bucket_numels: list[int]   # per bucket
    bucket_keys: list[int]     # per bucket
    members: list[list[int]]   # per bucket, in planned arrival order


class BucketPlan:
    """Buckets over params given by their numels (registration order), filled in `order` (None:
    reverse registration order); a bucket closes once it holds more than `cap` elements (bucket 0:
    `first_cap`, 0 meaning cap); params whose `keys` differ never share a bucket. With
    `assignment` (a bucket id per param, 0..nb-1) the buckets are given instead, e.g. those of a
    ZeRO partition plan: the planner then only counts readiness and reports the frontier."""

    def __init__(self, numels: Sequence[int], cap: int, order: Optional[Sequence[int]] = None,
                 keys: Optional[Sequence[int]] = None, align: int = 1, first_cap: int = 0,
                 assignment: Optional[Sequence[int]] = None) -> None:
        core = _core()
        self._mark = core.bucket_plan_mark
        self._core = core
        self._plan = core.bucket_plan(list(numels), int(cap), None if order is None else list(order),
                                      None if keys is None else list(keys), int(align), int(first_cap),
                                      None if assignment is None else [int(b) for b in assignment])
        bucket_of, offset_of, numels_b, keys_b, members = core.bucket_plan_layout(self._plan)
        self.layout = BucketLayout(bucket_of, offset_of, numels_b, keys_b, members)

    @property
    def num_buckets(self) -> int:
        return len(self.layout.bucket_numels)

    def reset(self) -> None:
        self._core.bucket_plan_reset(self._plan)

    def mark(self, param: int) -> int:
        """Marks a param's gradient ready; returns the frontier (buckets below it are ready)."""
        return self._mark(self._plan, param)

    def marker(self) -> Callable[[int], int]:
        """`mark` as one C call bound to this plan (no Python frame): what a gradient hook calls once per
        parameter per backward, where a method call's overhead would show."""
        return functools.partial(self._mark, self._plan)

    def mark_all(self) -> int:
        return self._core.bucket_plan_mark_all(self._plan)

    def frontier(self) -> int:
        return self._core.bucket_plan_frontier(self._plan)

    def pending(self) -> list[int]:
        return self._core.bucket_plan_pending(self._plan)

    def arrival(self) -> list[int]:
        return self._core.bucket_plan_arrival(self._plan)
