"""SuperOffload's deferred commit: the step returns before the host has stepped every bucket, and the next
forward takes each bucket's new weights only when it reaches the module that uses them (ZeRO-3's fetch calls
the store's before_read hook with the units it is about to read). BucketTracker is the meeting point: the
worker marks the elements it has stepped (with the CUDA event of their copy up, or the host tensor holding
them on a CPU run), the training thread waits there for a bucket to be complete."""
from __future__ import annotations

import bisect
import threading
from typing import Any, Optional, Sequence


class BucketTracker:

    def __init__(self, ranges: Sequence[Sequence[tuple[int, int]]]) -> None:
        """ranges[g][b]: [start, end) of bucket b's chunk in group g's partition."""
        self.ranges = [list(r) for r in ranges]
        self.starts = [[s for s, _ in r] for r in self.ranges]
        self.cv = threading.Condition()
        self.left: dict[tuple[int, int], int] = {}  # bucket -> elements not stepped yet in this step
        self.ready: dict[tuple[int, int], tuple[Any, Optional[Any]]] = {}  # bucket -> (copy-up event, host source)
        self.failed: Optional[BaseException] = None

    def clear(self) -> None:
        with self.cv:
            self.left, self.ready, self.failed = {}, {}, None

    def stepped(self, g: int, start: int, end: int, event: Any, source: Optional[Any]) -> None:
        """Worker: [start, end) of group g is stepped; `event` (CUDA) follows its copy up, `source` is the host
        tensor (whole partition) holding the result."""
        with self.cv:
            b = bisect.bisect_right(self.starts[g], start) - 1
            while start < end and b < len(self.ranges[g]):
                lo, hi = self.ranges[g][b]
                n = min(end, hi) - max(start, lo)
                if n > 0:
                    key = (g, b)
                    left = self.left.get(key, hi - lo) - n
                    self.left[key] = left
                    if left == 0:
                        self.ready[key] = (event, source)
                start = max(start, hi)
                b += 1
            self.cv.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cv:
            self.failed = err
            self.cv.notify_all()

    def wait(self, key: tuple[int, int]) -> tuple[Any, Optional[Any]]:
        """Training thread: blocks until bucket `key` is stepped; its (event, source)."""
        with self.cv:
            while key not in self.ready:
                if self.failed is not None:
                    raise RuntimeError("SuperOffload: the host step failed") from self.failed
                self.cv.wait()
            return self.ready[key]
