"""sha256 digests of a checkpoint's tensors, computed on a few threads at once.

A 1.3B ZeRO checkpoint holds ~18 GB of tensors; hashing them one after another on the saving thread took
longer than writing them. hashlib releases the GIL while it hashes a large buffer, so the tensors are hashed
on a small pool of threads, and save_file starts them before torch.save so the two overlap. The digests are
the same sha256 values, in the same manifest, as before."""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child makes its own


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            workers = max(1, min(8, (os.cpu_count() or 2) - 1))
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsc-digest"))
        return _pool[1]


_serial: tuple[int, ThreadPoolExecutor] | None = None


def hash_thread() -> ThreadPoolExecutor:
    """One thread for a file's running sha256: updates submitted to it run in submission order."""
    global _serial
    with _lock:
        if _serial is None or _serial[0] != os.getpid():
            _serial = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsc-file-sha"))
        return _serial[1]


def submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """pool.submit, or `fn` run here when the interpreter is shutting down (an exit-time checkpoint commit:
    concurrent.futures refuses new work then)."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future = Future()
        done.set_result(fn(*args))
        return done


def tensor_digest(t: torch.Tensor) -> str:
    # through the buffer protocol: a host tensor is not copied (a checkpoint's partitions can be most of a
    # rank's memory)
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy() if flat.numel() else b"").hexdigest()


def _walk(obj: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((prefix or "<root>", obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), out)


def tensor_entries_async(obj: Any, digest: bool = True) -> Callable[[], dict[str, dict[str, Any]]]:
    """Start hashing `obj`'s tensors; the returned call waits and gives name -> shape, dtype (and sha256
    unless digest=False), in `obj`'s order. `obj`'s tensors must not change until it has returned."""
    named: list[tuple[str, torch.Tensor]] = []
    _walk(obj, "", named)
    entries = {name: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for name, t in named}
    if not digest:
        return lambda: entries
    pool = _executor()
    futures: list[tuple[str, Future]] = [(name, submit(pool, tensor_digest, t)) for name, t in named]

    def finish() -> dict[str, dict[str, Any]]:
        for name, fut in futures:
            entries[name]["sha256"] = fut.result()
        return entries

    return finish


def tensor_entries(obj: Any, digest: bool = True) -> dict[str, dict[str, Any]]:
    """name -> shape, dtype (and sha256 unless digest=False) of every tensor in `obj`."""
    return tensor_entries_async(obj, digest)()
