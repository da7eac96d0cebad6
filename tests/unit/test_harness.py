"""The multi-process harness itself: real collectives on 2 and 4 ranks (on the backend
DSC_TEST_BACKEND names, each rank on its rank_device()), a failing rank reported with its
traceback, a hang that fails in bounded time leaving no process behind, and an NCCL run with too
few GPUs skipped with the reason."""
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.harness import BACKEND_ENV, DistributedTestError, backend_choice, rank_device, run_distributed, visible_gpus


def all_reduce_body(rank, world_size):
    dev = rank_device()
    t = torch.tensor([float(rank + 1)], device=dev)
    dist.all_reduce(t)
    gathered = [torch.zeros(1, device=dev) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)], device=dev))
    return t.item(), [g.item() for g in gathered], str(dev), str(dist.get_backend()), torch.cuda.device_count()


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives(world_size):
    results = run_distributed(all_reduce_body, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    on_gpu = backend_choice() == "nccl"
    for rank, (total, gathered, dev, backend, gpus) in enumerate(results):
        assert (total, gathered) == (expected_sum, [float(r) for r in range(world_size)])
        assert backend == backend_choice()
        assert dev == (f"cuda:{rank}" if on_gpu else "cpu")
        if not on_gpu:
            assert gpus == 0  # gloo ranks see no GPU, on any machine


def test_nccl_with_too_few_gpus_skips_naming_why(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "nccl")
    want = visible_gpus() + 1
    with pytest.raises(pytest.skip.Exception, match=f"needs {want} CUDA GPU\\(s\\).*{want - 1} visible"):
        run_distributed(all_reduce_body, want)
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="DSC_TEST_BACKEND must be 'gloo' or 'nccl'"):
        run_distributed(all_reduce_body, 2)


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
    # multiprocessing's own resource tracker and the fork server (started here when no earlier test
    # started it) may appear; no rank (or rank child) may remain
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE
             and not any(k in " ".join(p.cmdline()) for k in ("resource_tracker", "forkserver"))}
    assert after <= before
