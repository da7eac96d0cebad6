"""Long-lived host buffers for offload, page-locked for the GPU at exactly their size.

`torch.empty(n, pin_memory=True)` takes torch's caching pinned allocator, which rounds every block up to a power
of two: ZeRO-Offload's fp32 master partition of a 6.9B model (27.4 GB) locks 32 GiB, its bf16 gradient staging
(13.7 GB) 16 GiB. `host_empty` gives a buffer of its own (core_host_memory.c: an anonymous mapping registered with
the CUDA runtime torch loaded), so offload's host memory is what its buffers hold. A buffer torch frees is
released (unregistered, unmapped) only after the device has been synchronized, by `release_freed()` (the next
`host_empty` calls it, and the engine's destroy): a copy still queued on it never meets memory that is gone. Small buffers (under EXACT_MIN_BYTES) still take torch's allocator, whose cache serves their
repeated allocations; so does everything when the runtime cannot be found, registration fails, or
DSC_EXACT_PINNED=0. Without a GPU, or with pin=False, a buffer is an ordinary (pageable) CPU tensor."""
from __future__ import annotations

import ctypes
import functools
import math
import os
from typing import Optional, Sequence, Union

import torch

EXACT_MIN_BYTES = 1 << 20
_PORTABLE = 1  # cudaHostRegisterPortable: locked for every CUDA context of the process


@functools.lru_cache(maxsize=1)
def _runtime_register() -> Optional[tuple[int, int]]:
    """(cudaHostRegister, cudaHostUnregister) of the CUDA runtime library torch loaded, or None."""
    if os.environ.get("DSC_EXACT_PINNED", "1") == "0" or not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "libcudart.so" in line.split()[-1]})
        if not loaded:
            return None
        # another package may have loaded another runtime: take the one of torch's CUDA major version
        major = f"libcudart.so.{(torch.version.cuda or '').split('.')[0]}"
        path = next((p for p in loaded if major in p), loaded[0])
        lib = ctypes.CDLL(path)  # the already-loaded library: the same runtime state as torch's
        return (ctypes.cast(lib.cudaHostRegister, ctypes.c_void_p).value or 0,
                ctypes.cast(lib.cudaHostUnregister, ctypes.c_void_p).value or 0)
    except (OSError, AttributeError):
        return None


def release_freed() -> int:
    """Releases the exact buffers torch has freed, after synchronizing the current device; returns their bytes."""
    from deepspeed_c import _C

    if _C.host_freed_bytes() == 0:
        return 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return int(_C.host_release_freed())


def _exact_pinned(nbytes: int) -> Optional[torch.Tensor]:
    fns = _runtime_register()
    if fns is None or not all(fns):
        return None
    from deepspeed_c import _C

    release_freed()
    try:
        return torch.from_dlpack(_C.host_alloc(nbytes, fns[0], fns[1], _PORTABLE))
    except RuntimeError:  # the driver refused (locked-memory limit): torch's allocator decides
        return None


def host_empty(shape: Union[int, Sequence[int]], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialised host tensor; page-locked (exactly its size) when pin is set and a GPU is present."""
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    numel = math.prod(dims)
    pin = pin and torch.cuda.is_available()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if pin and nbytes >= EXACT_MIN_BYTES:
        raw = _exact_pinned(nbytes)
        if raw is not None:
            return raw.view(dtype).view(dims)
    return torch.empty(dims, dtype=dtype, pin_memory=pin)


def host_zeros(shape: Union[int, Sequence[int]], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    return host_empty(shape, dtype, pin).zero_()
