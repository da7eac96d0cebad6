"""instrument_w_nvtx (DeepSpeed's deepspeed.utils.nvtx): a decorator that marks each call of a function as a
profiler range named by its qualified name, through the accelerator's range_push/range_pop (NVTX on CUDA,
nothing on CPU); left out while torch.compile traces, where it would break the graph."""
from __future__ import annotations

import functools
from typing import Any, Callable

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"


def _compiling() -> bool:
    import torch

    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


def _accelerator() -> Any:
    from deepspeed_c.accelerator import get_accelerator

    return get_accelerator()


def instrument_w_nvtx(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapped_fn(*args: Any, **kwargs: Any) -> Any:
        marked = enable_nvtx and not _compiling()
        if marked:
            _accelerator().range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            if marked:
                _accelerator().range_pop()

    return wrapped_fn
