from __future__ import annotations

import contextlib
import os
from typing import Any

from deepspeed_c.accelerator.abstract_accelerator import DeepSpeedAccelerator


class _HostEvent:
    """A CUDA-event-shaped timer for the host: record() stamps the time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0


class _HostStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class CPU_Accelerator(DeepSpeedAccelerator):
    _name = "cpu"
    _communication_backend_name = "gloo"
    _legacy_tensor_types = True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        # one logical "device" per local rank, as DeepSpeed's CPU accelerator reports
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def is_synchronized_device(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def total_memory(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.virtual_memory().available

    def memory_allocated(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self.memory_allocated(device_index)

    # host memory has no cache: DeepSpeed's CPU accelerator reports the process's resident set
    def get_rss(self) -> int:
        return self.memory_allocated()

    def reset_rss(self) -> int:
        return self.memory_allocated()

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_allocated(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        return None

    @property
    def Stream(self) -> Any:
        return _HostStream

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return _HostStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return _HostStream()

    @property
    def Event(self) -> Any:
        return _HostEvent
