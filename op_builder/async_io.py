"""DeepNVMe's builders: AsyncIOBuilder (the C async I/O core behind `aio_handle`) and GDSBuilder
(GPUDirect Storage, which deepspeed_c does not provide: it always reports itself incompatible)."""
from __future__ import annotations

import os
import sys
from types import ModuleType

from .builder import OpBuilder


def io_uring_available() -> bool:
    """Whether this process may create an io_uring (the kernel has it and no seccomp profile or
    sysctl refuses it): one tiny ring is set up and closed through the raw system call."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import os

    nr_setup = 425  # io_uring_setup: the same number on x86-64 and aarch64 (the generic table)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        fd = libc.syscall(nr_setup, 1, params)
    except (OSError, AttributeError):
        return False
    if fd < 0:
        return False
    os.close(fd)
    return True


def engine_description() -> str:
    """The async I/O engine a handle gets here (for the env report)."""
    if os.environ.get("DSC_AIO_ENGINE") == "pread":
        return "pread/pwrite worker threads (DSC_AIO_ENGINE=pread)"
    if io_uring_available():
        return "io_uring per worker thread (raw system calls), O_DIRECT where the filesystem allows"
    return "pread/pwrite worker threads (io_uring refused here), O_DIRECT where the filesystem allows"


class AsyncIOBuilder(OpBuilder):
    """`AsyncIOBuilder().load().aio_handle(...)` as in DeepSpeed. The C core needs no library
    (no libaio/liburing): worker threads keep queue_depth blocks in flight each through io_uring's
    system calls (pread/pwrite where io_uring is unavailable), O_DIRECT where the filesystem allows."""

    NAME = "async_io"

    def sources(self) -> list[str]:
        return ["core/async_io.c", "core/async_io_uring.c", "py/aio_binding.c"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), "-pthread"]

    def extra_ldflags(self) -> list[str]:
        return ["-pthread"]

    def incompatible_reason(self) -> str | None:
        base = super().incompatible_reason()
        if base:
            return base
        if not sys.platform.startswith("linux"):
            return f"async_io needs Linux (pread/pwrite with O_DIRECT); this is {sys.platform}"
        return None

    def load_core(self, verbose: bool = False) -> ModuleType:
        """The raw extension module (contexts in capsules); `load()` wraps it."""
        return super().load(verbose)

    def load(self, verbose: bool = False) -> ModuleType:
        """The module with DeepSpeed's `aio_handle` class (built on first use)."""
        self.load_core(verbose)
        import importlib

        return importlib.import_module("deepspeed_c.ops.aio")


class GDSBuilder(AsyncIOBuilder):
    """GPUDirect Storage (cuFile) handles: not built by deepspeed_c."""

    NAME = "gds"

    def incompatible_reason(self) -> str | None:
        return ("GPUDirect Storage (cuFile, DeepSpeed's gds_handle) is not provided by deepspeed_c; "
                "use AsyncIOBuilder's aio_handle (set aio.use_gds to false)")

    def load(self, verbose: bool = False) -> ModuleType:
        raise RuntimeError(f"op 'gds' cannot be built here: {self.incompatible_reason()}")
