"""Several worlds of different sizes, one after the other, in ONE launch of processes.

A distributed test module that needs runs at 2, 3 and 4 ranks (a checkpoint saved at one world size and
loaded at another) pays a launch per run_distributed call: forked ranks, a rendezvous, a first engine's
warm-up. run_worlds starts max(world) ranks once (run_distributed, its backend choice included); each phase
is a fresh default process group of its own world size on the first `world` ranks (the others wait for the
next phase), so every phase is still a real multi-process run of that world size, its collectives among
exactly its ranks, and phases see each other's files only (a later phase loads what an earlier one saved).
What carries over between phases is a rank's process: its imports, and process-global state, which the
bodies given here must not rely on (each builds its own model and engine); the expert and tensor-parallel
groups deepspeed_c caches are forgotten after each phase.

    phases = [(2, save_body, (path,)), (4, load_body, (path,))]
    by_phase = run_worlds(phases)   # by_phase[1][r]: load_body's result on rank r of the 4-rank world

The phases' groups rendezvous on the launch's own store (the one run_distributed serves on a port the OS
picked), each under a key prefix of its own: no further port is picked or bound."""
from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Sequence

from tests.harness import run_distributed

Phase = tuple[int, Callable[..., Any], Sequence[Any]]


def _forget_cached_groups() -> None:
    """deepspeed_c.utils.groups caches the expert and tensor-parallel groups it made; they belong to the process
    group just destroyed (a later phase reusing them on some ranks only would hang), so they are forgotten."""
    import sys

    groups = sys.modules.get("deepspeed_c.utils.groups")
    if groups is not None:
        groups._reset_expert_groups()
        groups._reset_tp_groups()


def _phases_body(rank: int, size: int, phases: Sequence[Phase]) -> list[Any]:
    import torch.distributed as dist

    backend = dist.get_backend()
    dist.destroy_process_group()  # the launch's group of all `size` ranks; each phase makes its own
    timeout = datetime.timedelta(seconds=float(os.environ.get("_DSC_STORE_TIMEOUT", "300")))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
                          timeout=timeout)
    out: list[Any] = []
    for i, (world, fn, args) in enumerate(phases):
        if rank >= world:
            out.append(None)
            continue
        os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group(backend, store=dist.PrefixStore(f"phase{i}/", store), rank=rank, world_size=world,
                                timeout=timeout)
        try:
            out.append(fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
            _forget_cached_groups()
    os.environ.update(WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    return out


def run_worlds(phases: Sequence[Phase], timeout: float = 300.0) -> list[list[Any]]:
    """Run each phase (world, fn, args) in turn as fn(rank, world, *args) on ranks 0..world-1 of one launch, in
    a fresh default process group of `world` ranks. Returns, per phase, the results of its ranks in order.
    A rank's failure in any phase fails the call (run_distributed's report names the rank)."""
    if not phases:
        raise ValueError("run_worlds: phases is empty")
    for world, fn, _ in phases:
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"run_worlds: a phase's world must be a positive int, got {world!r} for {fn!r}")
    size = max(world for world, _, _ in phases)
    per_rank = run_distributed(_phases_body, size, args=(list(phases),), timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i, (world, _, _) in enumerate(phases)]
