"""Giving back the pages of a file-mapped checkpoint tensor once its bytes have been read.

torch.load(mmap=True) maps the whole file privately; every page a reader touches stays resident (and
counts in the process's memory) until the whole mapping goes away. A loader that reads a ZeRO file one
partition after another would therefore end up holding all of it. On Linux, madvise(MADV_DONTNEED) on
a range of a private file mapping that was only read drops those pages: a later read pages them in
again from the file, so the data stays correct.

That call would zero memory that is not such a mapping, so a MappedPages only releases tensors whose
storage it recorded from the mapped load itself, rounded inward to whole pages of that tensor."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Any, Optional

import torch

_MADV_DONTNEED = 4
_libc: Any = None


def _madvise() -> Optional[Any]:
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = lib.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


class MappedPages:
    """The storages of one mapped load (`obj` as torch.load(mmap=True) returned it; `mapped` False for a
    file read whole, whose tensors are then never released)."""

    def __init__(self, obj: Any, mapped: bool) -> None:
        self._storages: set[int] = set()
        if mapped:
            self._storages = {t.untyped_storage().data_ptr() for t in _tensors(obj)
                              if t.device.type == "cpu" and t.numel()}

    def release(self, t: torch.Tensor) -> None:
        """Drop the resident pages of `t` (a tensor of the mapped load, or a view of one)."""
        fn = _madvise()
        if fn is None or t.device.type != "cpu" or not t.numel() or not t.is_contiguous() or \
                t.untyped_storage().data_ptr() not in self._storages:
            return
        page = mmap.PAGESIZE
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end > start:
            fn(start, end - start, _MADV_DONTNEED)
