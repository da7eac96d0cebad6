"""The multi-process harness itself: real collectives on 2 and 4 ranks, a failing rank reported
with its traceback, and a hang that fails in bounded time leaving no process behind."""
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedTestError, run_distributed


def all_reduce_body(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    return t.item(), [g.item() for g in gathered]


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives(world_size):
    results = run_distributed(all_reduce_body, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(expected_sum, [float(r) for r in range(world_size)])] * world_size


def failing_body(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def test_failing_rank_is_reported():
    with pytest.raises(DistributedTestError, match="rank one is unhappy"):
        run_distributed(failing_body, 2, timeout=60)


def hanging_body(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def test_hang_times_out_and_leaves_no_children():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(hanging_body, 2, timeout=15, backend="none")
    assert time.monotonic() - start < 40
    time.sleep(0.5)
    # multiprocessing's own resource tracker may appear; no rank (or rank child) may remain
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())}
    assert after <= before
