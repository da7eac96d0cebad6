"""The ZeRO-3 fetch plan: a thin wrapper over the C planner (`_C.fetch_plan`,
csrc/include/dsc/fetch_plan.h has the full contract).

From the trace of the first iteration (for each module step, in execution order, the ids of the
parameter units it needs) the planner decides, for every step, which units to all-gather when it
begins and which to release when it ends. Every rank computes the same plan from the same trace.

Executing step i::

    for group in plan.fetch_at(i):      # group 0: step i's own missing units (may be empty)
        all_gather(group)               # later groups: prefetched units of coming steps
    run the module
    release(plan.release_at(i))

The lists handed out are the plan's own (built once, so per-module access costs one index):
read them, do not mutate them.
"""
from __future__ import annotations

from typing import Optional, Sequence


class FetchPlan:
    """A built plan; make one with `FetchPlan.build`."""

    __slots__ = ("num_steps", "peak_live_numel", "_fetch", "_release", "_live_fetch", "_live_release", "_cap")

    def __init__(self, fetch: list[list[list[int]]], release: list[list[int]], live_after_fetch: list[int],
                 live_after_release: list[int], cap: list[int], peak: int) -> None:
        self._fetch = fetch
        self._release = release
        self._live_fetch = live_after_fetch
        self._live_release = live_after_release
        self._cap = cap
        self.num_steps: int = len(fetch)
        self.peak_live_numel: int = peak

    @classmethod
    def build(cls, steps: Sequence[Sequence[int]], numels: Sequence[int],
              persistent: Optional[Sequence[bool]] = None, *, prefetch_bucket_size: int,
              max_live_parameters: int, max_reuse_distance: int, min_prefetch_batch: int = 0) -> "FetchPlan":
        """Plans `steps` (per step, the distinct unit ids it needs) over units of `numels` elements;
        `persistent` (per unit, or None for none) units are gathered once and never released.
        Limits are element counts >= 0; prefetch_bucket_size 0 disables prefetch; min_prefetch_batch > 0
        holds back a step's prefetches smaller than it while the window is full (fewer, larger gathers; see
        csrc/include/dsc/fetch_plan.h). Raises
        ValueError/TypeError naming the bad argument (e.g. a unit id out of range)."""
        steps = [s if isinstance(s, (list, tuple)) else list(s) for s in steps]
        numels = numels if isinstance(numels, (list, tuple)) else list(numels)
        if persistent is not None and not isinstance(persistent, (list, tuple)):
            persistent = list(persistent)
        from deepspeed_c import _C

        return cls(*_C.fetch_plan(steps, numels, persistent, prefetch_bucket_size, max_live_parameters,
                                  max_reuse_distance, min_prefetch_batch))

    def fetch_at(self, step: int) -> list[list[int]]:
        """The all-gather groups to issue when `step` begins: group 0 is the step's own units not
        yet live (possibly empty), each later group a non-empty coalesced batch of prefetches."""
        return self._fetch[step]

    def release_at(self, step: int) -> list[int]:
        """The units to release once `step` has run (ascending ids)."""
        return self._release[step]

    def live_numel_after_fetch(self, step: int) -> int:
        """Live non-persistent elements once step's fetches are done (its peak)."""
        return self._live_fetch[step]

    def live_numel_after_release(self, step: int) -> int:
        return self._live_release[step]

    def step_cap(self, step: int) -> int:
        """max(max_live_parameters, numel of the step's own non-persistent units)."""
        return self._cap[step]

    def __repr__(self) -> str:
        return f"FetchPlan(num_steps={self.num_steps}, peak_live_numel={self.peak_live_numel})"
