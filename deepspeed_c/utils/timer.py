"""Wall-clock timers for `wall_clock_breakdown` and the samples/s throughput line (DeepSpeed's names).

SynchronizedWallClockTimer keeps named timers (the engine uses the *_TIMER names below). On a
device whose accelerator says host timers are wrong (CUDA: work is asynchronous) a timer records
device events and reads them when asked; otherwise it reads the host clock after
`get_accelerator().synchronize()`. deepspeed_c.accelerator is imported on first use, and when it
is missing the timers fall back to the host clock alone.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Iterable, Sequence

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6

_clock: Callable[[], float] = time.perf_counter  # seconds; tests substitute a fake clock


def _accelerator() -> Any | None:
    try:
        from deepspeed_c.accelerator import get_accelerator
        return get_accelerator()
    except (ImportError, AttributeError):
        return None


def _synchronize() -> None:
    acc = _accelerator()
    if acc is not None and hasattr(acc, "synchronize"):
        acc.synchronize()


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _gib(*fn_names: str) -> float:
    """GiB from the first of the accelerator's memory statistics that exists (0 without one)."""
    acc = _accelerator()
    for name in fn_names:
        fn = getattr(acc, name, None) if acc is not None else None
        if fn is not None:
            try:
                return fn() / 1024**3
            except Exception:  # a device without memory statistics
                return 0.0
    return 0.0


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """Mean after dropping round(n * trim_percent) values from each end."""
    assert 0.0 <= trim_percent <= 1.0
    values = sorted(data)
    n = len(values)
    if n == 0:
        return 0.0
    k = int(round(n * trim_percent))
    kept = values[k:n - k]
    return sum(kept) / len(kept) if kept else 0.0


class _EventPair:
    """Start and end device events of one timed interval."""

    def __init__(self, start_event: Any, end_event: Any) -> None:
        self.start_event = start_event
        self.end_event = end_event

    def get_elapsed_msec(self) -> float:
        self.end_event.synchronize()
        return self.start_event.elapsed_time(self.end_event)


class SynchronizedWallClockTimer:
    """A group of named timers; `timers("fwd").start()` ... `.stop()`, then `log([...])`."""

    class Timer:

        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.event_timers: list[Any] = []
            acc = _accelerator()
            use_host = getattr(acc, "use_host_timers", None) if acc is not None else None
            self.use_host_timer = True if use_host is None or not hasattr(acc, "Event") else bool(use_host())
            self.start_event = None
            self.elapsed_records: list[float] | None = None
            self.start_time = 0.0

        def start(self) -> None:
            assert not self.started_, f"{self.name_} timer has already been started"
            if self.use_host_timer:
                _synchronize()
                self.start_time = _clock()
            else:
                self.start_event = _accelerator().Event(enable_timing=True)
                self.start_event.record()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            assert self.started_, f"{self.name_} timer is not started"
            if self.use_host_timer:
                _synchronize()
                self.event_timers.append(_clock() - self.start_time)
            else:
                end_event = _accelerator().Event(enable_timing=True)
                end_event.record()
                self.event_timers.append(_EventPair(self.start_event, end_event))
                self.start_event = None
            self.started_ = False

        def _get_elapsed_msec(self) -> float:
            if self.use_host_timer:
                self.elapsed_records = [seconds * 1000.0 for seconds in self.event_timers]
            else:
                self.elapsed_records = [pair.get_elapsed_msec() for pair in self.event_timers]
            return sum(self.elapsed_records)

        def reset(self) -> None:
            self.started_ = False
            self.start_event = None
            self.elapsed_records = None
            self.event_timers.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds recorded so far (a running interval is closed and reopened)."""
            running = self.started_
            if running:
                self.stop()
            elapsed_ms = self._get_elapsed_msec()
            if reset:
                self.reset()
            if running:
                self.start()
            return elapsed_ms

        def mean(self) -> float:
            """Trimmed mean (10% off each end) of the recorded intervals, in milliseconds."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records or [], 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, "SynchronizedWallClockTimer.Timer"]:
        return self.timers

    def __call__(self, name: str) -> "SynchronizedWallClockTimer.Timer":
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        return (f" | mem_allocated: {_gib('memory_allocated'):.4f} GB"
                f" | max_mem_allocated: {_gib('max_memory_allocated'):.4f} GB"
                f" | cache_allocated: {_gib('memory_cached', 'memory_reserved'):.4f} GB"
                f" | max_cache_allocated: {_gib('max_memory_cached', 'max_memory_reserved'):.4f} GB")

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Sequence[int] | None = None) -> None:
        """Print `time (ms) | fwd: 1.23 | ...` on `ranks` (default [0]); printed whatever the log level."""
        assert normalizer > 0.0
        text = "time (ms)"
        for name in names:
            if name in self.timers:
                text += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        if memory_breakdown:
            text += self.memory_usage()
        wanted = list(ranks) if ranks else [0]
        rank = _rank()
        if -1 in wanted or rank in wanted:
            print(f"[Rank {rank}] {text}", flush=True)

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """{name: trimmed mean interval in milliseconds / normalizer} for the timers that exist."""
        assert normalizer > 0.0
        means = {}
        for name in names:
            if name in self.timers:
                means[name] = self.timers[name].mean() / normalizer
                if reset:
                    self.timers[name].reset()
        return means


class NoopTimer:
    """Same interface as SynchronizedWallClockTimer, measuring nothing (wall_clock_breakdown off)."""

    class Timer:

        def start(self) -> None:
            ...

        def reset(self) -> None:
            ...

        def stop(self, **kwargs: Any) -> None:
            ...

        def elapsed(self, **kwargs: Any) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> "NoopTimer.Timer":
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Sequence[int] | None = None) -> None:
        ...

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> None:
        ...


class _DefaultThroughputConfig:
    enabled = True
    synchronized = True


class ThroughputTimer:
    """Samples per second over global steps, skipping the first `start_step` steps (warm-up).

    The engine calls start() before each micro-step's forward and stop(global_step=...) after it;
    every `steps_per_output` global steps the running and current samples/s are logged.
    `config` has `enabled` and `synchronized` (the `timers.throughput` section); None means both on.
    """

    def __init__(self, config: Any, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None,
                 monitor_memory: bool = False, logging_fn: Callable[[str], None] | None = None) -> None:
        self.config = config if config is not None else _DefaultThroughputConfig()
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        if steps_per_output is not None and steps_per_output <= 0:
            raise ValueError(f"steps_per_output must be a positive integer or None, got {steps_per_output}")
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn if logging_fn is not None else logging.getLogger("DeepSpeed").info
        self.initialized = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _init_timer(self) -> None:
        self.initialized = True

    def start(self) -> None:
        if not self.config.enabled:
            return
        self._init_timer()
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                _synchronize()
            self.start_time = _clock()

    def _is_report_boundary(self) -> bool:
        if self.steps_per_output is None:
            return False
        return self.global_step_count % self.steps_per_output == 0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            if self.config.synchronized:
                _synchronize()
            self.end_time = _clock()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self._is_report_boundary():
                    self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                                 f"global_step={self.global_step_count}, "
                                 f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                                 f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
                                 f"MemAllocated={round(_gib('memory_allocated'), 2)}GB, "
                                 f"MaxMemAllocated={round(_gib('max_memory_allocated'), 2)}GB")
                    if self.monitor_memory:
                        import psutil
                        self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                                     f"global_step={self.global_step_count}, "
                                     f"vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}")
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed steps (those after start_step); -inf before any."""
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
