"""deepspeed.runtime.rollout.continuous_batching: slot scheduling for continuous-batching rollouts.

The scheduler only bookkeeps: which rows of the previous decode batch survive (keep_slots, for compacting a KV
cache or a batch), which requests retired and which pending ones were admitted into the freed rows (appended
after the survivors). Running the model is the caller's job."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(frozen=True)
class ContinuousBatchRequest:
    """One request waiting for, or holding, a row of the decode batch."""
    request_id: Hashable


@dataclass(frozen=True)
class ContinuousBatchUpdate:
    """One transition: `active` is the new batch in row order (survivors first, in their old order, then the
    admitted); keep_slots are the survivors' rows in the previous batch."""
    active: tuple[ContinuousBatchRequest, ...]
    keep_slots: tuple[int, ...]
    retired: tuple[Hashable, ...]
    admitted: tuple[ContinuousBatchRequest, ...]

    @property
    def active_ids(self) -> tuple[Hashable, ...]:
        return tuple(r.request_id for r in self.active)

    @property
    def admitted_slots(self) -> tuple[int, ...]:
        """Rows of the new batch that hold the admitted requests (the last len(admitted) rows)."""
        return tuple(range(len(self.active) - len(self.admitted), len(self.active)))


class ContinuousBatchScheduler:
    """First-in first-out admission into at most max_batch_size rows. Every request may generate up to
    max_new_tokens tokens; advance() counts one decode step for every active row and retires the rows that
    reached the budget, plus any the caller names as finished (an EOS)."""

    def __init__(self, max_batch_size: int, max_new_tokens: int) -> None:
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive; got {max_batch_size}")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive; got {max_new_tokens}")
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self._waiting: deque[ContinuousBatchRequest] = deque()
        self._rows: list[ContinuousBatchRequest] = []
        self._steps: dict[Hashable, int] = {}  # tokens generated so far, per active request id
        self._ids: set[Hashable] = set()  # ids submitted and not yet retired

    @property
    def active(self) -> tuple[ContinuousBatchRequest, ...]:
        return tuple(self._rows)

    @property
    def pending(self) -> tuple[ContinuousBatchRequest, ...]:
        return tuple(self._waiting)

    def submit(self, request: ContinuousBatchRequest) -> None:
        if not isinstance(request, ContinuousBatchRequest):
            raise TypeError(f"request must be a ContinuousBatchRequest; got {type(request).__name__}")
        if request.request_id in self._ids:
            raise ValueError(f"duplicate request_id: {request.request_id!r} is already pending or active")
        self._ids.add(request.request_id)
        self._waiting.append(request)

    def _check_active(self, finished: set) -> None:
        active = {r.request_id for r in self._rows}
        for rid in finished:
            if rid not in active:
                raise ValueError(f"finished request is not active: {rid!r}")

    def schedule(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """Retires `finished_ids`, then fills the free rows from the queue; advances no token counts."""
        finished = set(finished_ids)
        self._check_active(finished)
        keep = [row for row, r in enumerate(self._rows) if r.request_id not in finished]
        retired = tuple(r.request_id for r in self._rows if r.request_id in finished)
        rows = [self._rows[row] for row in keep]
        admitted = []
        while len(rows) < self.max_batch_size and self._waiting:
            request = self._waiting.popleft()
            self._steps[request.request_id] = 0
            rows.append(request)
            admitted.append(request)
        for rid in retired:
            self._steps.pop(rid, None)
            self._ids.discard(rid)
        self._rows = rows
        return ContinuousBatchUpdate(tuple(rows), tuple(keep), retired, tuple(admitted))

    def advance(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """One decode step for every active row, then schedule() with the rows that finished (named by the
        caller, or out of token budget)."""
        finished = set(finished_ids)
        self._check_active(finished)
        for r in self._rows:
            self._steps[r.request_id] += 1
            if self._steps[r.request_id] >= self.max_new_tokens:
                finished.add(r.request_id)
        return self.schedule(finished)
