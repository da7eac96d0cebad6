"""Gloo process groups torn down while the interpreter is still alive.

A gloo worker thread drops its reference to a finished collective's tensors a moment after the caller's
wait() returned. When the caller's Python tensor object died first, torch hands that object to the C++
tensor, and the worker must take the GIL to free it. If the interpreter is being finalised by then,
Python ends the worker thread with a forced unwind, which aborts the whole process ("terminate called
without an active exception", SIGABRT 134) after a training run that succeeded. It happens in launched
2-rank runs on a loaded machine: the worker is not scheduled before the main thread reaches finalisation.

A destroyed process group joins its workers only when its last reference goes, and references outlive
destroy_process_group: a finished script's engines (cyclic garbage) and, a common one, the default
arguments of torch.distributed.nn.functional (`group=group.WORLD`, bound when the module is imported;
torch's FSDP imports it, and accelerate imports FSDP while saving state, after the group exists).

So at exit: destroy the default gloo group, collect garbage, drop destroyed groups bound as function
defaults, and, for any gloo worker still alive (a group the script still holds), wait with the GIL
released until the workers sleep."""
from __future__ import annotations

import atexit
import gc
import os
import time
import types
from typing import Any

import torch.distributed as dist

from deepspeed_c.comm import direct

_GLOO_THREAD_PREFIX = "pt_gloo"  # torch names gloo's worker threads pt_gloo_runloop
_IDLE_POLLS = 3  # consecutive samples with every worker asleep
_POLL_S = 0.01
_WAIT_LIMIT_S = 1.0

_hooked = False
_gloo_seen = False


def register(backend_name: str) -> None:
    """Called whenever deepspeed_c finds torch.distributed initialised (by itself or by the caller)."""
    global _hooked, _gloo_seen
    _gloo_seen = _gloo_seen or "gloo" in backend_name
    if not _hooked:
        _hooked = True
        atexit.register(teardown)


def teardown() -> None:
    try:
        direct.clear()  # its entries hold process groups
        if dist.is_initialized() and "gloo" in str(dist.get_backend()):
            dist.destroy_process_group()
        if not _gloo_seen:
            return
        gc.collect()
        if gloo_worker_threads():
            drop_destroyed_group_defaults()
            gc.collect()
        wait_for_idle_gloo_workers(_WAIT_LIMIT_S)
    except Exception:  # exit path: a failure here must not turn a finished run into a failed one
        pass


def gloo_worker_threads() -> list[str]:
    """Thread ids of this process's live gloo workers ([] where /proc is not there to tell)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(_GLOO_THREAD_PREFIX):
                    out.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _is_destroyed_group(value: Any) -> bool:
    return isinstance(value, dist.ProcessGroup) and value not in dist.distributed_c10d._world.pg_map


def drop_destroyed_group_defaults() -> int:
    """Replaces destroyed process groups bound as function defaults by None (the default group's value once
    it is gone); returns how many were dropped. A destroyed group can no longer serve a call anyway."""
    dropped = 0
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some objects answer with a warning
        # (torch.distributed.reduce_op's deprecation)
        if type(obj) is not types.FunctionType:
            continue
        defaults = obj.__defaults__
        if defaults and any(_is_destroyed_group(d) for d in defaults):
            obj.__defaults__ = tuple(None if _is_destroyed_group(d) else d for d in defaults)
            dropped += 1
        kw = obj.__kwdefaults__
        if kw and any(_is_destroyed_group(v) for v in kw.values()):
            obj.__kwdefaults__ = {k: (None if _is_destroyed_group(v) else v) for k, v in kw.items()}
            dropped += 1
    return dropped


def _asleep(tid: str) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # the thread is gone
    return state in ("S", "I")


def wait_for_idle_gloo_workers(limit_s: float) -> bool:
    """Sleeps (GIL released) until every live gloo worker is seen asleep several samples in a row, so a
    worker that still frees a finished collective's tensors does it before finalisation; True if idle."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < _IDLE_POLLS:
        tids = gloo_worker_threads()
        if not tids:
            return True
        time.sleep(_POLL_S)
        quiet = quiet + 1 if all(_asleep(t) for t in tids) else 0
        if time.monotonic() > deadline:
            return False
    return True
