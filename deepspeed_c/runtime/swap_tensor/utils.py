"""Checks and helpers the swappers share: the nvme_path is usable and has room, swap folders."""
from __future__ import annotations

import itertools
import os
import shutil
import weakref
from typing import Any

from deepspeed_c.runtime.swap_tensor.aio_config import AioConfig


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def local_ranks_sharing_disk() -> int:
    """The ranks of this node, which write to the same nvme_path."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")) or 1))
    except ValueError:
        return 1


def check_nvme_path(key: str, path: Any, bytes_needed: int) -> str:
    """`path` (config key `key`) is a writable directory, created when missing as DeepSpeed does, and its
    filesystem has room for bytes_needed on each of this node's ranks; else ValueError/OSError naming the
    path and the bytes."""
    need = f"{bytes_needed} bytes ({human_bytes(bytes_needed)}) per rank"
    if path is None or str(path) == "":
        raise ValueError(f"config key '{key}' must name a directory for the swap files when device is 'nvme' "
                         f"(they need {need})")
    path = os.fspath(path)
    if not os.path.lexists(path):
        try:
            os.makedirs(path, exist_ok=True)  # exist_ok: another local rank may create it first
        except OSError as e:
            # keep the OS's class (PermissionError, NotADirectoryError when a parent is a file, ...)
            raise type(e)(e.errno, f"config key '{key}': {path} does not exist and cannot be created "
                          f"({e.strerror}; the swap files need {need}); point '{key}' at a writable directory "
                          f"on a fast local disk") from e
    if not os.path.isdir(path):
        raise NotADirectoryError(f"config key '{key}': {path} is not a directory (the swap files need {need})")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"config key '{key}': {path} is not writable by this process (the swap files need "
                              f"{need})")
    ranks = local_ranks_sharing_disk()
    free = shutil.disk_usage(path).free
    if free < bytes_needed * ranks:
        raise OSError(f"config key '{key}': {path} has {free} bytes ({human_bytes(free)}) free, but the swap files "
                      f"need {need} x {ranks} local rank(s) = {bytes_needed * ranks} bytes "
                      f"({human_bytes(bytes_needed * ranks)})")
    return path


_instances = itertools.count()


def fresh_folder(path: str, owner: Any) -> tuple[str, Any]:
    """A new empty folder `<path>.<pid>.<n>` for one swapper's files, so two engines of one process
    (or two runs) sharing an nvme_path never write each other's files, and its remover: called by
    the owner's close(), else when the owner is garbage collected or the process exits."""
    folder = f"{path}.{os.getpid()}.{next(_instances)}"
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)
    return folder, weakref.finalize(owner, shutil.rmtree, folder, True)


def new_handle(aio: AioConfig) -> Any:
    """A handle for swap files: rewritten in place every step (no temporary and rename)."""
    from deepspeed_c.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load().aio_handle(**aio.handle_kwargs(), atomic_writes=False)
