"""Exact-size page-locked host buffers (csrc/py/core_host_memory.c, deepspeed_c/accelerator/host_memory.py).

On the host the CUDA registration is stood in for by ctypes callbacks that record their calls: a buffer is its
own page-aligned mapping of exactly the bytes asked for, registered once with its mapped size and the portable
flag (and kept out of forked children: MADV_DONTFORK), unregistered once after torch frees the storage (not while a view of it lives) and only when the freed
blocks are released (after a device synchronize), and an unconsumed capsule's block is released too; a refused registration raises naming the bytes and the CUDA error, leaving nothing mapped.
host_empty / host_zeros give ordinary CPU tensors without a GPU. On a GPU: buffers are pinned at their exact size
(torch's allocator would round 5 MB + 1 up to 8 MiB), and a non-blocking round trip through one is exact."""
from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from deepspeed_c import _C
from deepspeed_c.accelerator import host_memory

REG = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
UNREG = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding `address` (/proc/self/smaps; neighbours may be merged in)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and int(head.split("-")[0], 16) <= address < int(head.split("-")[1], 16):
            for follow in lines[i + 1:]:
                if follow.startswith("VmFlags:"):
                    return follow.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_exact_buffer_lifetime_with_a_recording_registrar():
    log: list = []
    reg = REG(lambda p, n, f: log.append(("reg", p, n, f)) or 0)
    unreg = UNREG(lambda p: log.append(("unreg", p)) or 0)
    raw = torch.from_dlpack(_C.host_alloc(5000, _addr(reg), _addr(unreg), 1))
    assert raw.shape == (5000,) and raw.dtype == torch.uint8 and raw.data_ptr() % 4096 == 0
    assert log == [("reg", raw.data_ptr(), 8192, 1)]  # whole pages, the flag passed through
    assert "dc" in _vm_flags(raw.data_ptr()), "a registered buffer must not be copied into forked children"
    view = raw.view(torch.float32)[10:20]
    view.fill_(2.5)
    del raw
    gc.collect()
    assert len(log) == 1, "unregistered while a view still held the storage"
    assert float(view.sum()) == 25.0
    ptr = log[0][1]
    del view
    gc.collect()
    assert len(log) == 1 and _C.host_freed_bytes() == 8192, "released before the device could be synchronized"
    assert _C.host_release_freed() == 8192 and _C.host_freed_bytes() == 0
    assert log[1:] == [("unreg", ptr)]
    capsule = _C.host_alloc(100, _addr(reg), _addr(unreg), 0)  # never given to torch
    del capsule
    gc.collect()
    assert host_memory.release_freed() == 4096
    assert [e[0] for e in log] == ["reg", "unreg", "reg", "unreg"]


def test_refusals_name_the_problem():
    refuse = REG(lambda p, n, f: 2)
    unreg = UNREG(lambda p: 0)
    with pytest.raises(RuntimeError, match=r"page-locking 4096 bytes .*CUDA error 2"):
        _C.host_alloc(4096, _addr(refuse), _addr(unreg), 0)
    with pytest.raises(ValueError, match="nbytes"):
        _C.host_alloc(0, 0, 0, 0)
    with pytest.raises(ValueError, match="both"):
        _C.host_alloc(64, _addr(refuse), 0, 0)
    plain = torch.from_dlpack(_C.host_alloc(3, 0, 0, 0))  # no registrar: a plain zeroed mapping
    assert plain.tolist() == [0, 0, 0]


def test_host_empty_without_a_gpu_is_a_plain_tensor(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = host_memory.host_zeros((3, 4), torch.bfloat16)
    assert t.shape == (3, 4) and t.dtype == torch.bfloat16 and not t.is_pinned() and float(t.abs().sum()) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_exact_pinned_on_a_gpu():
    host_memory._runtime_register.cache_clear()
    assert host_memory._runtime_register() is not None, "the CUDA runtime torch loaded was not found"
    n = 5_000_001  # bytes; torch's pinned allocator would lock 8 MiB for it
    t = host_memory.host_empty(n, torch.uint8)
    assert t.is_pinned() and t.numel() == n
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    src = torch.arange(n // 4, dtype=torch.float32)
    buf = host_memory.host_empty(n // 4, torch.float32)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before  # not torch's pool
    buf.copy_(src)
    dev = buf.to("cuda", non_blocking=True)
    back = host_memory.host_zeros(n // 4, torch.float32)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
