"""Steady-state timing of the offload engines in benchmarks/offload.py: where a timed block starts and ends, and
how the host work left in flight at its end is finished outside the clock, for deepspeed_c's and the real
DeepSpeed's engines alike.

ZenFlow (with overlap_step) hands the interval's accumulated gradient to a background host step at every
update boundary and takes its result at the next boundary, blocking there if the host step has not finished.
Its steady state is periodic with the update interval, so a fair block is a whole number of intervals that
starts right after a boundary handed a fresh host step to the background and ends the same way: inside the
clock the block then waits for exactly steps / update_interval host steps (the one handed off just before it
and every one it hands off itself but the last); the last, still in flight at the block's end, belongs to
no block: it is waited for outside the clock (the "tail") so that it does not run beside another engine's
block. DeepSpeed's ZenFlow keeps two host steps in flight (DS_DEPTH): its lead-in runs three boundaries
after the tail, the first two taking results already there, so that its block starts as its steady state
does (the step handed off a boundary earlier just started, the fresh one queued) and ends the same way. count() reads how many host steps a deepspeed_c block handed off and took, which the benchmark
asserts equal to steps / update_interval.

Before the first block every engine runs warm-up steps (warm_up): at least two update intervals, so one
whole host step has run (its first call allocates the host Adam moments: ~11 GB zeroed for a 1.4B model,
a one-time cost that is no part of a steady state) and a second has been taken."""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

SEM_T_BYTES = 32  # sizeof(sem_t) of glibc on x86_64 and aarch64: DeepSpeed's control block starts with two
# DeepSpeed 0.19.8's ZenFlow (overlap_step, no warm-up rounds) skips the wait at its first two boundaries (the
# optimizer process not started yet; then "first update round after warm-up"), so from then on a boundary waits
# for the host step handed off two boundaries before it: two host steps may be in flight (one running, one
# queued), and its done semaphore rests at 2
DS_DEPTH = 2


def zf_of(engine: Any) -> Any:
    """deepspeed_c's ZenFlow step strategy of an engine, else None."""
    return getattr(getattr(engine, "optimizer", None), "zenflow_step", None)


def interval(engine: Any) -> int:
    """The update interval of a ZenFlow engine (deepspeed_c's or DeepSpeed's), 0 for any other engine."""
    zf = zf_of(engine)
    if zf is not None:
        return int(zf.sched.update_interval) if zf.sched.overlap_step else 0
    if getattr(engine, "zenflow", False) and getattr(engine, "overlap_step", False):
        return int(getattr(engine, "update_interval", 0))
    return 0


def block_steps(engines: dict[str, Any], steps: int) -> int:
    """steps rounded up to a multiple of every ZenFlow engine's update interval."""
    for e in engines.values():
        k = interval(e)
        if k > 1 and steps % k:
            steps += k - steps % k
    return steps


def lead_in(engine: Any, step: Callable[[], Any]) -> None:
    """Untimed steps into the steady state: a ZenFlow engine's until an update boundary has just handed a host
    step to the background; SuperOffload's deferred step one step, whose host work the block's first forward
    meets as every later one does."""
    opt = getattr(engine, "optimizer", None)
    zf = zf_of(engine)
    if getattr(getattr(opt, "offload", None), "inflight", "no") is None:
        step()
    if zf is not None:
        for _ in range(64):
            if zf.pending is not None and zf.accumulated == 0:
                return
            step()
        raise RuntimeError("ZenFlow: no update boundary within 64 steps (update_interval 'auto'?): not timing")
    k = interval(engine)
    if k:  # DeepSpeed's ZenFlow: micro_steps counts steps; a boundary is a step that leaves it a multiple of k
        for _ in range(DS_DEPTH + 1):
            step()
            while engine.micro_steps % k:
                step()


def settle(engine: Any, limit_s: float = 60.0) -> float:
    """The host work in flight finished, outside the clock; returns the seconds waited. deepspeed_c: ZenFlow's
    background host step, SuperOffload's deferred step. DeepSpeed's ZenFlow: its optimizer process has posted
    the `done` semaphore of every step handed to it (read without taking it, so the engine's own waits still
    find them): at rest it holds DS_DEPTH (the boundaries that skipped their wait; 1 after the first)."""
    opt = getattr(engine, "optimizer", None)
    t0 = time.perf_counter()
    for part in (zf_of(engine), getattr(opt, "offload", None)):
        if hasattr(part, "settle"):
            part.settle()
    ctrl = getattr(opt, "zf_ctrl", None)
    if ctrl is not None and getattr(opt, "process_optimizer_established", False):
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.c_int(0)
        addr = ctypes.c_void_p(ctrl.data_ptr() + SEM_T_BYTES)
        while time.perf_counter() - t0 < limit_s:
            if libc.sem_getvalue(addr, ctypes.byref(value)) != 0:
                raise OSError(ctypes.get_errno(), "sem_getvalue on DeepSpeed's ZenFlow control block")
            if value.value >= min(DS_DEPTH, int(getattr(engine, "global_steps", DS_DEPTH))):
                break
            time.sleep(0.002)
        else:
            raise RuntimeError(f"DeepSpeed's ZenFlow host step not done after {limit_s:.0f} s")
    return time.perf_counter() - t0


def warm_up(engine: Any, step: Callable[[], Any]) -> None:
    """Untimed steps before the first block: two update intervals of a ZenFlow engine (one host step run whole,
    its result taken at the next boundary), then its work in flight finished."""
    k = interval(engine)
    if k:
        lead_in(engine, step)  # a host step handed off
        for _ in range(k):  # the next boundary takes it and hands off another
            step()
        settle(engine)


def count(engine: Any) -> tuple[int, int]:
    """deepspeed_c ZenFlow's host steps handed off and taken so far (0, 0 for any other engine)."""
    zf = zf_of(engine)
    if zf is None:
        return 0, 0
    return int(zf.stats["handoffs"]), int(zf.stats["joins"])


def transposed_weights(engine: Any, reference: Any) -> int:
    """How many 2-D weights of engine's model differ from reference's same-named ones but equal, element for
    element, the reference's transpose laid out in the weight's shape (read before any step)."""
    import torch

    ref = dict(reference.module.named_parameters())
    bad = 0
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            q = ref.get(name)
            if q is None or p.dim() != 2 or p.shape != q.shape or p.shape[0] == 1 or p.shape[1] == 1:
                continue
            q = q.detach().to(device=p.device, dtype=p.dtype)
            if not torch.equal(p, q) and torch.equal(p.reshape(-1), q.t().contiguous().reshape(-1)):
                bad += 1
    return bad
