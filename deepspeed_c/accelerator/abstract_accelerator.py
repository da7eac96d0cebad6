"""The accelerator interface (DeepSpeed's `DeepSpeedAccelerator`): what the runtime asks of a
device family. Implementations: cpu_accelerator.CPU_Accelerator, cuda_accelerator.CUDA_Accelerator."""
from __future__ import annotations

import abc
import contextlib
from typing import Any


class DeepSpeedAccelerator(abc.ABC):
    _name: str = ""
    _communication_backend_name: str = ""

    # --- identity -----------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    @abc.abstractmethod
    def is_available(self) -> bool: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def device(self, device_index: int | None = None) -> Any:
        import torch

        return torch.device(self.device_name(device_index))

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None: ...

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # --- RNG ----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        import torch

        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> Any:
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, new_state: Any, device_index: int | None = None) -> None:
        import torch

        torch.set_rng_state(new_state)

    def random(self) -> Any:
        import torch

        return torch.random

    def default_generator(self, device_index: int) -> Any:
        """The device's default torch.Generator (Megatron's RNG tracker swaps its state)."""
        import torch

        return torch.default_generator

    # --- typed tensor constructors (DeepSpeed's FloatTensor, LongTensor, ...) -------------------
    # On the host DeepSpeed hands out torch's legacy types (which also take sizes); on a device, a
    # torch.tensor(data) constructor placed there.
    _legacy_tensor_types: bool = False

    def _typed(self, dtype_name: str, legacy: str) -> Any:
        import functools

        import torch

        if self._legacy_tensor_types:
            return getattr(torch, legacy)
        return functools.partial(torch.tensor, dtype=getattr(torch, dtype_name), device=self._name)

    @property
    def BFloat16Tensor(self) -> Any:
        return self._typed("bfloat16", "BFloat16Tensor")

    @property
    def ByteTensor(self) -> Any:
        return self._typed("uint8", "ByteTensor")

    @property
    def DoubleTensor(self) -> Any:
        return self._typed("double", "DoubleTensor")

    @property
    def FloatTensor(self) -> Any:
        return self._typed("float", "FloatTensor")

    @property
    def HalfTensor(self) -> Any:
        return self._typed("half", "HalfTensor")

    @property
    def IntTensor(self) -> Any:
        return self._typed("int", "IntTensor")

    @property
    def LongTensor(self) -> Any:
        return self._typed("long", "LongTensor")

    # --- dtypes -------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def supported_dtypes(self) -> list[Any]:
        import torch

        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # --- torch.compile ----------------------------------------------------------------------
    def get_compile_backend(self) -> str:
        return getattr(self, "_compile_backend", "inductor")

    def set_compile_backend(self, backend: str) -> None:
        import torch

        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self._name}. Supported Backends are {supported}")
        self._compile_backend = backend

    # --- capability queries and graphs (DeepSpeed's defaults: no triton, no graph capture) ---
    supports_nvtx_domain = False

    def is_triton_supported(self) -> bool:
        return False

    def prefer_triton_grouped_mm(self) -> bool:
        return False

    def is_fp64_supported(self) -> bool:
        return True

    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self) -> Any:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    # --- memory -------------------------------------------------------------------------
    def pin_memory(self, tensor: Any, align_bytes: int = 1) -> Any:
        return tensor

    def pin_empty(self, *size: Any, dtype: Any, device: Any = "cpu") -> Any:
        """A new host tensor of `size` and `dtype`, pinned where this accelerator pins host memory."""
        import torch

        if torch.device(device).type != "cpu":
            raise ValueError(f"pin_empty allocates host memory; device must be cpu, got {device!r}")
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
        return self.pin_memory(torch.empty(shape, dtype=dtype, device="cpu"))

    def pin_empty_like(self, tensor: Any, device: Any = "cpu", dtype: Any = None) -> Any:
        return self.pin_empty(tuple(tensor.shape), dtype=tensor.dtype if dtype is None else dtype, device=device)

    def unpin_memory(self, tensor: Any) -> None:
        return None  # torch frees page-locked memory with the tensor

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        return False

    def unregister_host_memory(self, address: int) -> None:
        return None

    def pin_memory_alignment(self) -> int:
        return 1

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        return self.reset_peak_memory_stats(device_index)

    def is_pinned(self, tensor: Any) -> bool:
        return False

    def on_accelerator(self, tensor: Any) -> bool:
        return tensor.device.type == self._name

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        return 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return 0

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        return None

    def memory_reserved(self, device_index: int | None = None) -> int:
        return 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        return None

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return {}

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int: ...

    # --- streams and events ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def Stream(self) -> Any: ...

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any: ...

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any: ...

    @property
    @abc.abstractmethod
    def Event(self) -> Any: ...

    # --- tracing ------------------------------------------------------------------------
    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    def lazy_call(self, callback: Any) -> None:
        callback()

    # --- environment --------------------------------------------------------------------
    def visible_devices_envs(self) -> list[str]:
        return []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return []

    # --- op builders --------------------------------------------------------------------
    def op_builder_dir(self) -> str:
        return "deepspeed_c.ops.op_builder"

    def get_op_builder(self, class_name: str) -> type | None:
        """The builder class by DeepSpeed's class name (e.g. "CPUAdamBuilder"), or None."""
        from deepspeed_c.ops import op_builder

        return getattr(op_builder, class_name, None)

    def create_op_builder(self, class_name: str) -> Any:
        builder = self.get_op_builder(class_name)
        return builder() if builder is not None else None

    def build_extension(self) -> Any:
        raise NotImplementedError("deepspeed_c builds ops with op_builder, not torch's BuildExtension")
