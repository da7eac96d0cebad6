"""`checkpoint: {"writer": {...}}`: checkpoint files written in the background (DeepSpeed 0.19.8's
checkpoint writers, runtime/model_checkpointing/ and runtime/checkpoint_engine/, by their config names).

save_checkpoint builds each rank's files as usual but, instead of writing them, copies their tensors into
private host memory (the "staging": training may then change the live ones) and hands them to a writer
thread, which writes them into the checkpoint's staging directory. save_checkpoint returns then. The
commit (each rank's manifest entries gathered, the manifest written, the directory renamed into place,
`latest` replaced; store.py's crash-safe protocol, the manifest last) happens at the next commit point,
on every rank together: engine.checkpoint_commit(), the next save_checkpoint, load_checkpoint or
engine.destroy(). A crash before it leaves the previous checkpoint and `latest` as they were; a failed
background write is raised at the commit point (and its staging directory removed).

Writer types: "python" and "fast" write with torch.save from the writer thread ("fast" stages device
tensors into pinned host memory, copied without blocking; staging buffers are reused from save to save,
staging_pool.py); "mock" stages and writes nothing and commits nothing (DeepSpeed's
benchmark writer: it measures the staging alone). `decoupled: true` stages into shared memory and a child
process writes the files (process_writer.py), as DeepSpeed's decoupled writer; the thread then only waits. io_buffer_size,
io_buffer_double, io_multiplier and data_parallel are validated and reported with show_statistics."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from deepspeed_c.checkpoint import store
from deepspeed_c.runtime.checkpointing.staging_pool import StagingPool
from deepspeed_c.utils.logging import logger

WRITER_TYPES = ("MOCK", "PYTHON", "FAST")
DATA_PARALLEL_UNITS = ("REPLICA", "SOCKET", "MACHINE")
_KEYS = ("type", "decoupled", "io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel", "io_multiplier")


@dataclass(frozen=True)
class WriterConfig:
    type: str = "FAST"
    decoupled: bool = False
    io_buffer_size: int = 64 * 1024 ** 2
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: Optional[str] = None
    io_multiplier: int = 1
    host_cache_bytes: Optional[int] = None  # datastates_ckpt.host_cache_size: staging beyond it is written at once

    @classmethod
    def parse(cls, section: Optional[Mapping[str, Any]]) -> Optional["WriterConfig"]:
        """checkpoint.writer (None: files are written synchronously). Bad keys and values raise naming them."""
        if section is None:
            return None
        if not isinstance(section, Mapping):
            raise ValueError(f"checkpoint.writer must be a dict, got {type(section).__name__}")
        unknown = sorted(set(section) - set(_KEYS))
        if unknown:
            raise ValueError(f"checkpoint.writer: unknown keys {unknown} (valid: {list(_KEYS)})")
        kind = str(section.get("type", cls.type)).upper()
        if kind not in WRITER_TYPES:
            raise ValueError(f"checkpoint.writer.type {section.get('type')!r} is not a checkpoint writer; valid: "
                             f"{[t.lower() for t in WRITER_TYPES]}")
        unit = section.get("data_parallel")
        unit = str(unit).upper() if unit is not None else None
        if unit is not None and unit not in DATA_PARALLEL_UNITS:
            raise ValueError(f"checkpoint.writer.data_parallel {section['data_parallel']!r} is not one of "
                             f"{[u.lower() for u in DATA_PARALLEL_UNITS]}")
        size = int(float(section.get("io_buffer_size", cls.io_buffer_size)))
        mult = int(section.get("io_multiplier", cls.io_multiplier))
        if size <= 0 or mult <= 0:
            raise ValueError(f"checkpoint.writer: io_buffer_size ({size}) and io_multiplier ({mult}) must be positive")
        return cls(type=kind, decoupled=bool(section.get("decoupled", False)), io_buffer_size=size,
                   io_buffer_double=bool(section.get("io_buffer_double", True)),
                   show_statistics=bool(section.get("show_statistics", False)), data_parallel=unit, io_multiplier=mult)


    @classmethod
    def from_datastates(cls, section: Any) -> Optional["WriterConfig"]:
        """DeepSpeed's `datastates_ckpt: {"host_cache_size": GB}` (the DataStates-LLM engine) mapped onto the
        background writer: up to host_cache_size GB of each save is staged in host memory and written in the
        background, the rest before save_checkpoint returns. None when the section is absent or false."""
        if section is None or section is False:
            return None
        if section is True:
            section = {}
        if not isinstance(section, Mapping):
            raise ValueError(f"datastates_ckpt must be a dict, got {type(section).__name__}")
        unknown = sorted(set(section) - {"host_cache_size"})
        if unknown:
            raise ValueError(f"datastates_ckpt: unknown keys {unknown} (valid: ['host_cache_size'])")
        size = section.get("host_cache_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0):
            raise ValueError(f"datastates_ckpt.host_cache_size must be a positive number of GB, got {size!r}")
        return cls(type="PYTHON", decoupled=True,
                   host_cache_bytes=int(size * 1024 ** 3) if size is not None else None)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class BackgroundWriter:
    """One rank's writer: stage() snapshots files, start() writes them from a thread, wait() joins it and
    returns their manifest entries (or raises the write's failure)."""

    def __init__(self, config: WriterConfig) -> None:
        self.config = config
        self._jobs: list[tuple[str, Any, str]] = []
        self._thread: Optional[threading.Thread] = None
        self._entries: dict[str, dict] = {}
        self._error: Optional[BaseException] = None
        self._staged_s = 0.0
        self._staged_bytes = 0
        self._written: dict[str, dict] = {}  # files over the host cache, written while staging
        self._pool = StagingPool(shared=config.decoupled)  # host buffers reused from one save to the next
        self._process: Optional[Any] = None  # decoupled: the child process that writes
        if config.decoupled and self.writes:
            from deepspeed_c.runtime.checkpointing.process_writer import ProcessWriter

            self._process = ProcessWriter()

    @property
    def process_pid(self) -> Optional[int]:
        """The pid of the decoupled writer's child process (None: written by a thread, or not started yet)."""
        return self._process.pid if self._process is not None else None

    @property
    def writes(self) -> bool:
        return self.config.type != "MOCK"

    def stage(self, name: str, obj: dict, path: str) -> None:
        store.check_plain(obj, name)  # refused now, on the saving call, not later in the thread
        cap = self.config.host_cache_bytes
        if cap is not None and self.writes and self._staged_bytes + _nbytes(obj) > cap:
            self._written[name] = store.save_file(obj, path)  # the cache is full: written now
            return
        self._staged_bytes += _nbytes(obj)
        start = time.perf_counter()
        if self._thread is not None:
            raise RuntimeError("checkpoint writer: stage() while a background write runs (commit it first)")
        pin = self.config.type == "FAST" and torch.cuda.is_available()
        self._jobs.append((name, self._pool.snapshot(obj, pin), path))
        self._staged_s += time.perf_counter() - start

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("checkpoint writer: a background write is already running (commit it first)")
        jobs, self._jobs = self._jobs, []
        self._entries, self._error = dict(self._written), None
        self._written, self._staged_bytes = {}, 0
        self._thread = threading.Thread(target=self._run, args=(jobs,), name="dsc-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, jobs: list[tuple[str, Any, str]]) -> None:
        start, total = time.perf_counter(), 0
        try:
            total = sum(_nbytes(obj) for _, obj, _ in jobs)
            if self._process is not None:  # decoupled: the child process writes, this thread only waits
                self._entries.update(self._process.write(jobs))
            elif self.writes:
                for name, obj, path in jobs:
                    self._entries[name] = store.save_file(obj, path)
        except BaseException as e:  # noqa: BLE001 (raised on the training thread at the commit point)
            self._error = e
        jobs.clear()  # the staged views are dropped before wait() lets the pool reuse the buffers
        if self.config.show_statistics:
            took = time.perf_counter() - start
            logger.info(f"checkpoint writer ({self.config.type.lower()}"
                        f"{', decoupled process' if self._process is not None else ''}): staged in {self._staged_s:.3f}s, "
                        f"wrote {total / 1e6:.1f} MB in {took:.3f}s ({total / 1e6 / max(took, 1e-9):.1f} MB/s)")

    def wait(self) -> dict[str, dict]:
        """This rank's manifest entries once its background write is done; its failure, raised."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._pool.recycle()  # the write has read its buffers: the next save may reuse them
        self._staged_s = 0.0
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"checkpoint writer: the background write of the previous checkpoint failed: {error}; "
                               "it was not committed (the checkpoints before it are untouched)") from error
        return self._entries

    def discard(self) -> None:
        """Drop staged files that will not be written (a save that raised before starting them)."""
        self._jobs, self._written, self._staged_bytes = [], {}, 0
        self._pool.recycle()


def at_exit(checkpointer: Any) -> None:
    """At interpreter exit, `checkpointer`'s pending background save is waited for; with one process (no
    process group, or a group of one) it is also committed, which needs no other rank. In a distributed
    run the commit is collective, so a save left pending at exit stays uncommitted (its staging directory
    is removed by the next save): call engine.checkpoint_commit() or engine.destroy() before exiting."""
    import atexit
    import weakref

    ref = weakref.ref(checkpointer)

    def finish() -> None:
        owner = ref()
        if owner is None or not owner.has_pending:
            return
        import torch.distributed as dist

        alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        try:
            if alone:
                owner.commit_pending()
            else:
                owner.writer.wait()
                logger.warning("checkpoint writer: the last background checkpoint was written but not committed "
                               "(call engine.checkpoint_commit() on every rank before exiting)")
        except Exception as e:  # noqa: BLE001 (at exit there is no caller left to raise to)
            logger.error(f"checkpoint writer: the background checkpoint pending at exit failed: {e}")

    atexit.register(finish)
