"""DeepNVMe's `aio_handle` (what `AsyncIOBuilder().load()` returns): DeepSpeed's names, defaults
and return values over the C async I/O core (csrc/core/async_io.c).

Differences from DeepSpeed 0.19.8, all deliberate:
- `wait()` with nothing pending returns 0 (DeepSpeed aborts the process).
- Any contiguous CPU tensor works with every call, page-locked or not, aligned or not; files hold
  exactly the buffer's bytes (DeepSpeed's legacy `write()` writes 0 bytes from a pageable tensor,
  and odd sizes are written short and then abort on the read back).
- A write at file_offset 0 replaces the file atomically (temporary name, rename on success); a
  failed write leaves the previous file as it was.
- Errors raise OSError/ValueError naming the file instead of returning -1 or aborting.
- A synchronous call waits for its own op only; async ops stay pending for `wait()`.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from deepspeed_c.accelerator.host_memory import host_empty
from deepspeed_c.ops.op_builder.async_io import AsyncIOBuilder

_core = AsyncIOBuilder().load_core()

_READ, _WRITE, _WRITE_IN_PLACE, _OVERWRITE = 0, 1, 2, 3
ALIGNMENT = 4096
# tensors from new_cpu_locked_tensor: data_ptr -> whether mlock succeeded
_locked: dict[int, bool] = {}


def backend() -> str:
    """The engine that moves blocks (for the env report)."""
    return _core.backend()


class aio_handle:  # noqa: N801  (DeepSpeed's class name)
    """Reads and writes whole tensors to files, synchronously or in the background."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, *, atomic_writes: bool = True) -> None:
        """atomic_writes (ours, keyword-only): a write at file_offset 0 goes to a temporary renamed over
        the file when complete; False rewrites the file in place and truncates it to the buffer's size
        (cheaper for scratch files rewritten every step, such as the swappers')."""
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"aio_handle: {name} must be an int, got {type(value).__name__}")
        self._block_size = block_size
        self._queue_depth = queue_depth
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._threads = intra_op_parallelism
        self._replace_mode = _WRITE if atomic_writes else _OVERWRITE
        use_direct = os.environ.get("DSC_AIO_DIRECT", "1") != "0"
        engine = os.environ.get("DSC_AIO_ENGINE", "io_uring")
        if engine not in ("io_uring", "pread"):
            raise ValueError(f"DSC_AIO_ENGINE must be 'io_uring' or 'pread', got {engine!r}")
        self._ctx = _core.create(block_size, queue_depth, int(single_submit), int(overlap_events),
                                 intra_op_parallelism, int(use_direct), int(engine == "io_uring"))
        # async ops not yet waited for: keeps their buffers alive and runs their post-actions
        self._pending: list[tuple[torch.Tensor, Optional[Callable[[], None]]]] = []

    # --- DeepSpeed's getters ---------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._threads

    def get_alignment(self) -> int:
        """DeepSpeed's value (threads x 4096): swappers pad tensor sizes to it."""
        return self._threads * ALIGNMENT

    def stats(self) -> dict[str, int]:
        """Counters of the core: ops, and blocks moved direct / bounced / through the page cache."""
        return _core.stats(self._ctx)

    # --- reads and writes ----------------------------------------------------------------
    def read(self, buffer: torch.Tensor, filename: Any, validate: bool, file_offset: int = 0) -> int:
        return self._run(_READ, buffer, filename, validate, False, file_offset)

    def write(self, buffer: torch.Tensor, filename: Any, validate: bool, file_offset: int = 0) -> int:
        return self._run(_WRITE, buffer, filename, validate, False, file_offset)

    def pread(self, buffer: torch.Tensor, filename: Any, validate: bool = False, *args: Any, **kwargs: Any) -> int:
        """pread(buffer, filename, validate, async, file_offset=0): `async` positional or as
        `**{"async": True}` (a Python keyword), or `is_async=`."""
        is_async, file_offset = _async_args("pread", args, kwargs)
        return self._run(_READ, buffer, filename, validate, is_async, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: Any, validate: bool = False, *args: Any, **kwargs: Any) -> int:
        is_async, file_offset = _async_args("pwrite", args, kwargs)
        return self._run(_WRITE, buffer, filename, validate, is_async, file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        return self._run(_READ, buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        return self._run(_WRITE, buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        return self._run(_READ, buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        """filename may also be an open file descriptor (an int), written in place."""
        return self._run(_WRITE, buffer, filename, False, True, file_offset)

    def wait(self) -> int:
        """Block (GIL released) until every async op has finished; the number completed (0 when
        none were pending). A failed op raises OSError naming its file, after all have finished."""
        pending, self._pending = self._pending, []
        count = _core.wait_all(self._ctx)
        for _, post in pending:
            if post is not None:
                post()
        return count

    def pending(self) -> int:
        return len(self._pending)

    # --- page-locked buffers ---------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned CPU tensor of example_tensor's dtype, page-locked: torch-pinned where
        CUDA is present, else mlock()ed (best effort: a small RLIMIT_MEMLOCK leaves it pageable,
        which costs nothing here since every buffer is usable)."""
        dtype = example_tensor.dtype
        nbytes = int(num_elem) * torch.empty((), dtype=dtype).element_size()
        # over-allocated by one alignment and cut at the first aligned byte (zero copy): torch's pinned
        # allocator, like its CPU one, places small blocks at any offset, and O_DIRECT needs the page
        pinned = torch.cuda.is_available()
        raw = host_empty(nbytes + ALIGNMENT, torch.uint8, pin=True) if pinned else \
            torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGNMENT
        t = raw[skip:skip + nbytes].view(dtype)
        _locked[t.data_ptr()] = True if pinned or not nbytes else bool(_core.lock_memory(t, 1))
        return t

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        locked = _locked.pop(tensor.data_ptr(), None)
        if locked is None:
            return False
        if locked and not tensor.is_pinned():
            _core.lock_memory(tensor, 0)
        return True

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in _locked or (tensor.device.type == "cpu" and tensor.is_pinned())

    # --- the one path every call takes ---------------------------------------------------------
    def _run(self, mode: int, buffer: torch.Tensor, filename: Any, validate: bool, is_async: bool,
             file_offset: int) -> int:
        path, mode = _path_of(filename, self._replace_mode if mode == _WRITE else mode)
        host, post = _host_buffer(buffer, path, mode)
        if not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"file_offset for {path} must be a non-negative int, got {file_offset!r}")
        if validate:
            post = _with_validation(post, host, path, file_offset)
        op = _core.submit(self._ctx, mode, int(is_async), host, os.fsencode(path), file_offset)
        if is_async:
            self._pending.append((host, post))
            return 0
        _core.wait_op(self._ctx, op)
        if post is not None:
            post()
        return 1

    def __del__(self) -> None:
        self._pending = []  # the capsule's destructor drains the core before buffers go


def _async_args(fn: str, args: tuple, kwargs: dict) -> tuple[bool, int]:
    if len(args) > 2:
        raise TypeError(f"{fn}() takes (buffer, filename, validate, async, file_offset=0)")
    is_async = args[0] if args else kwargs.pop("async", kwargs.pop("is_async", False))
    file_offset = args[1] if len(args) > 1 else kwargs.pop("file_offset", 0)
    if kwargs:
        raise TypeError(f"{fn}() got unexpected keyword arguments {sorted(kwargs)}")
    return bool(is_async), file_offset


def _path_of(filename: Any, mode: int) -> tuple[str, int]:
    if isinstance(filename, int) and not isinstance(filename, bool):
        # an open descriptor: reach its file through /proc and write into it in place
        return f"/proc/self/fd/{filename}", (_WRITE_IN_PLACE if mode != _READ else mode)
    return os.fspath(filename), mode


def _host_buffer(buffer: Any, path: str, mode: int) -> tuple[torch.Tensor, Optional[Callable[[], None]]]:
    """The contiguous CPU tensor the core moves, and what to do after a read completes."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer for {path} must be a torch.Tensor, got {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise ValueError(f"buffer for {path} is not contiguous (shape {tuple(buffer.shape)}, strides "
                         f"{buffer.stride()}); pass buffer.contiguous() or a page-locked buffer from "
                         f"new_cpu_locked_tensor")
    if buffer.device.type == "cpu":
        return buffer, None
    # a device tensor goes through a host copy (no GPUDirect Storage here)
    if mode == _READ:
        host = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu",
                           pin_memory=torch.cuda.is_available())
        return host, lambda: buffer.copy_(host)
    return buffer.detach().to("cpu"), None


def _with_validation(post: Optional[Callable[[], None]], host: torch.Tensor, path: str,
                     file_offset: int) -> Callable[[], None]:
    def check() -> None:
        if post is not None:
            post()
        nbytes = host.numel() * host.element_size()
        with open(path, "rb") as f:
            f.seek(file_offset)
            on_disk = f.read(nbytes)
        expected = host.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
        if on_disk != expected:
            raise OSError(f"validation failed: {path} does not hold the buffer's {nbytes} bytes at offset {file_offset}")
    return check
