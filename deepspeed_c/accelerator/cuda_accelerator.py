from __future__ import annotations

from typing import Any

from deepspeed_c.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):
    _name = "cuda"
    _communication_backend_name = "nccl"

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def is_available(self) -> bool:
        return self._torch.cuda.is_available()

    def device_count(self) -> int:
        return self._torch.cuda.device_count()

    def current_device(self) -> int:
        return self._torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        self._torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        self._torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        self._torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return self._torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> Any:
        return self._torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: Any, device_index: int | None = None) -> None:
        self._torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def random(self) -> Any:
        return self._torch.cuda.random

    def default_generator(self, device_index: int) -> Any:
        return self._torch.cuda.default_generators[device_index]

    def is_bf16_supported(self) -> bool:
        return self._torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        major, _ = self._torch.cuda.get_device_capability()
        return major >= 6

    def pin_memory(self, tensor: Any, align_bytes: int = 1) -> Any:
        return tensor.pin_memory()

    def is_pinned(self, tensor: Any) -> bool:
        return tensor.is_pinned()

    def empty_cache(self) -> None:
        self._torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._torch.cuda.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._torch.cuda.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return self._torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return self._torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = self._torch.cuda.mem_get_info(device_index)
        return free

    @property
    def Stream(self) -> Any:
        return self._torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        return self._torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> Any:
        return self._torch.cuda.Event

    supports_nvtx_domain = True

    def is_triton_supported(self) -> bool:
        # DeepSpeed's rule: triton kernels from compute capability 8 (Ampere) on
        return self.is_available() and self._torch.cuda.get_device_capability()[0] >= 8

    def is_current_stream_capturing(self) -> bool:
        return self._torch.cuda.is_current_stream_capturing()

    def create_graph(self) -> Any:
        return self._torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return self._torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def range_push(self, msg: str) -> None:
        self._torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        self._torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> None:
        self._torch.cuda._lazy_call(callback)

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"]
