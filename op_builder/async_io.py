"""DeepNVMe's builders: AsyncIOBuilder (the C async I/O core behind `aio_handle`) and GDSBuilder
(GPUDirect Storage, which deepspeed_c does not provide: it always reports itself incompatible)."""
from __future__ import annotations

import sys
from types import ModuleType

from .builder import OpBuilder


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
