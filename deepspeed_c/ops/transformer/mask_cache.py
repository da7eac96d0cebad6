"""The attention mask a layer stack shares, converted once: every DeepSpeedTransformerLayer of a model gets
the same mask tensor, and converting it anew in each layer cost four kernel launches a layer (a step of small
BERT layers on a fast GPU is bound by the host's launches). One entry per converter, keyed on the source
tensor's identity and version (an in-place change of the mask converts again) and the call's shape key; the
entry goes when the source tensor does."""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Hashable

import torch


def _cacheable(t: torch.Tensor) -> bool:
    # a mask that needs its own gradient, or a functorch wrapper, is converted per call (no cache)
    if type(t) is not torch.Tensor or t.requires_grad:
        return False
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return not (wrapped is not None and wrapped(t))


class ConvertedMask:
    """build() for `source` under `key`, reused while the same source tensor, unchanged, comes back."""

    def __init__(self) -> None:
        self._entry: tuple | None = None  # (weakref to the source, its version, key, converted): swapped whole
        self._lock = threading.Lock()

    def get(self, source: torch.Tensor, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not _cacheable(source):
            return build()
        entry = self._entry
        if entry is not None and entry[0]() is source and entry[1] == source._version and entry[2] == key:
            return entry[3]
        value = build()
        with self._lock:
            self._entry = (weakref.ref(source, self._forget), source._version, key, value)
        return value

    def _forget(self, ref: weakref.ref) -> None:
        with self._lock:
            if self._entry is not None and self._entry[0] is ref:
                self._entry = None
