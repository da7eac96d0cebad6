"""The SuperOffload worker's job queue: jobs come in as the gradient chunks of backward reach host memory (last
layers first) and, after the step, as the ordinary step's buckets. The worker takes the job earliest in the
model's forward order among those whose gradient has arrived: once backward is over the backlog is stepped
from the first layers on, which the next forward needs first, while a chunk still being copied down never
holds up one that is already there."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional


class ForwardOrderQueue:

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.items: list[tuple[tuple, Any, Optional[Callable[[], bool]]]] = []  # (order key, job, arrived?)
        self.active = 0

    def put(self, key: tuple, job: Any, arrived: Optional[Callable[[], bool]] = None) -> None:
        """key orders the jobs (smaller first); arrived() says whether the job's input is there already."""
        with self.cv:
            self.items.append((key, job, arrived))
            self.cv.notify_all()

    def get(self) -> Any:
        """The next job (blocks until there is one); the caller calls task_done() when it has run it."""
        with self.cv:
            while not self.items:
                self.cv.wait()
            ready = [k for k, (_, _, arrived) in enumerate(self.items) if arrived is None or arrived()]
            # none there yet: the oldest, whose copy down finishes first
            pick = min(ready, key=lambda k: self.items[k][0]) if ready else 0
            _, job, _ = self.items.pop(pick)
            self.active += 1
            return job

    def task_done(self) -> None:
        with self.cv:
            self.active -= 1
            self.cv.notify_all()

    def join(self) -> None:
        """Until every job put so far has run."""
        with self.cv:
            while self.items or self.active:
                self.cv.wait()

    def idle(self) -> bool:
        with self.cv:
            return not self.items and not self.active
