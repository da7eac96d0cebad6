"""Run a test body on N real processes (gloo on CPU, NCCL when GPUs are present).

Each rank is a new process (forked from a server that preloaded torch, see _context) with
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set and
the default process group initialised before the body runs. A hang fails in bounded time: on
timeout every rank's whole process tree is killed, and no child outlives the call.

    def body(rank: int, world_size: int, scale: float) -> float:
        t = torch.ones(1) * rank * scale
        dist.all_reduce(t)
        return t.item()

    results = run_distributed(body, world_size=2, args=(3.0,))
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable, Sequence

import psutil


class DistributedTestError(AssertionError):
    """A rank raised, died, or the run timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str | None,
               args: Sequence[Any], env: dict[str, str], results: "mp.Queue[Any]") -> None:
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if backend is None:
            chosen = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
        else:
            chosen = backend
        if chosen == "nccl":
            torch.cuda.set_device(rank)
        if chosen != "none":
            dist.init_process_group(chosen, rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            if chosen != "none" and dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including SystemExit from the body
        results.put((rank, False, traceback.format_exc()))


def _context() -> Any:
    """Rank processes fork from a server that has already imported torch (a fresh interpreter
    importing torch costs seconds, on every rank of every distributed test). The server is a clean
    single-threaded interpreter that imports nothing that touches CUDA (not even deepspeed_c, whose
    accelerator probe may), so each forked rank can still initialise CUDA; it is started with the
    test process's environment at first use."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tests.harness"])
    return ctx


def _kill_tree(proc: mp.process.BaseProcess) -> None:
    try:
        parent = psutil.Process(proc.pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    timeout: float = 120.0, backend: str | None = None,
                    env: dict[str, str] | None = None, start_method: str = "forkserver") -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size processes; return the per-rank results.

    backend: None picks nccl when enough GPUs are visible, else gloo; "none" skips
    init_process_group (for bodies that initialise the group themselves). start_method "spawn"
    gives each rank a fresh interpreter (memory tests: a forked rank's first writes to the
    server's preloaded pages count as its own resident growth).
    """
    ctx = _context() if start_method == "forkserver" else mp.get_context(start_method)
    results: "mp.Queue[Any]" = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(fn, r, world_size, port, backend, tuple(args), dict(env or {}), results),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"distributed test timed out after {timeout:.0f}s; ranks finished: {sorted(out)}")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode is not None and i not in out and p.exitcode != 0]
                if dead:
                    # give a dying rank's report a moment to arrive before declaring it lost
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        raise DistributedTestError(
                            f"rank(s) {dead} died with exit code(s) "
                            f"{[procs[i].exitcode for i in dead]} without reporting")
                else:
                    continue
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
                break  # one failing rank is enough; the others may be waiting on it
        if failures:
            raise DistributedTestError("a rank failed:\n" + "\n".join(failures))
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                _kill_tree(p)
            p.join(timeout=5)
        results.close()
