"""deepspeed.OnDevice: build modules and tensors directly on a device (e.g. "meta") in a dtype.

DeepSpeed's contract: inside `with OnDevice(dtype=torch.float16, device="meta"):` module
construction allocates on `device` and floating tensors come out in `dtype`; integer tensors keep
their dtype; `enabled=False` does nothing. Here the device comes from torch's own device context
and the dtype from torch's default dtype (both restored on exit), instead of patching torch's
constructors."""
from __future__ import annotations

from typing import Any, Optional

import torch


class OnDevice:
    """with OnDevice(dtype=torch.bfloat16, device="meta"): model = MyModel()"""

    def __init__(self, dtype: Optional[torch.dtype], device: Any = "meta", enabled: bool = True) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"OnDevice: dtype must be a floating torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._device_ctx: Any = None
        self._old_dtype: Optional[torch.dtype] = None

    def __enter__(self) -> "OnDevice":
        if not self.enabled:
            return self
        self._device_ctx = torch.device(self.device)
        self._device_ctx.__enter__()
        if self.dtype is not None:
            self._old_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None
        self._device_ctx.__exit__(*exc)
        self._device_ctx = None
