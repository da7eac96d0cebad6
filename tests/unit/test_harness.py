"""The multi-process harness itself: real collectives on 2 and 4 ranks (on the backend
DSC_TEST_BACKEND names, each rank on its rank_device()), a failing rank reported with its
traceback, a hang that fails in bounded time leaving no process behind, an NCCL run with too
few GPUs skipped with the reason, and ports: a run whose port another process holds is retried on a
fresh one, any other init failure is not; the deepspeed_c modules the rank server preloads touch no CUDA."""
import os
import socket
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tests import harness
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
        # 5 s: the preloaded rank server forks both ranks well within it, so rank 0 is alive and asleep when it ends
        run_distributed(hanging_body, 2, timeout=5, backend="none")
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    # multiprocessing's own resource tracker and the fork server (started here when no earlier test
    # started it) may appear; no rank (or rank child) may remain
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE
             and not any(k in " ".join(p.cmdline()) for k in ("resource_tracker", "forkserver"))}
    assert after <= before


def init_from_env_body(rank, world_size, fail):
    """A backend "none" body initialising its own group from MASTER_PORT (rank 0 listens on it)."""
    if fail:
        raise RuntimeError(f"init refused on rank {rank}")  # an init failure that is not a taken port
    dist.init_process_group("gloo")
    try:
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item(), int(os.environ["MASTER_PORT"])
    finally:
        dist.destroy_process_group()


def test_taken_port_is_retried_on_a_fresh_one_and_other_failures_are_not(monkeypatch):
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()  # another process's server on the picked port: rank 0 cannot listen on it
    taken = held.getsockname()[1]
    picked = []

    def picker():  # first the held port, then free ones
        picked.append(taken if not picked else harness.free_port())
        return picked[-1]

    try:
        monkeypatch.setattr(harness, "_pick_port", picker)
        results = run_distributed(init_from_env_body, 2, args=(False,), backend="none", timeout=60)
        assert len(picked) == 2 and picked[0] == taken  # one retry, on another port
        assert results == [(2.0, picked[1])] * 2
        # a different init failure fails the call at once: no retry, its own message
        picked.clear()
        with pytest.raises(DistributedTestError, match="init refused on rank") as info:
            run_distributed(init_from_env_body, 2, args=(True,), backend="none", timeout=60)
        assert len(picked) == 1 and "port was in use" not in str(info.value)
        # a port taken on every attempt fails after harness.PORT_ATTEMPTS runs, naming EADDRINUSE
        picked.clear()
        monkeypatch.setattr(harness, "_pick_port", lambda: picked.append(taken) or taken)
        want = f"in use .*on all {harness.PORT_ATTEMPTS} attempts(.|\\n)*EADDRINUSE"
        with pytest.raises(DistributedTestError, match=want):
            run_distributed(init_from_env_body, 2, args=(False,), backend="none", timeout=60)
        assert len(picked) == harness.PORT_ATTEMPTS
    finally:
        held.close()


def store_port_body(rank, world_size):
    return int(os.environ["MASTER_PORT"]), dist.get_world_size()


def test_gloo_run_joins_a_store_the_caller_already_listens_on(monkeypatch):
    """The default path picks no port: the caller's store is bound (port 0) before the ranks start,
    so the port cannot be taken in between; a different init failure of the harness's own init (gloo
    told to use a network interface that does not exist) fails at once."""
    monkeypatch.setattr(harness, "_pick_port", lambda: pytest.fail("the gloo path must not pick a port"))
    stores = []
    real = harness._parent_store

    def spy(world_size, timeout):
        stores.append(real(world_size, timeout))
        return stores[-1]

    monkeypatch.setattr(harness, "_parent_store", spy)
    results = run_distributed(store_port_body, 2, backend="gloo", timeout=60)
    # a retried rendezvous (harness.is_transient_rendezvous) takes a fresh store: the ranks joined the last one
    assert 1 <= len(stores) <= harness.PORT_ATTEMPTS and results == [(stores[-1].port, 2)] * 2
    before = len(stores)
    with pytest.raises(DistributedTestError, match="(?i)nonexistent_if0"):
        run_distributed(store_port_body, 2, backend="gloo", timeout=60, env={"GLOO_SOCKET_IFNAME": "nonexistent_if0"})
    assert len(stores) == before + 1  # an unknown interface is not retried


def test_transient_rendezvous_is_told_from_other_init_failures():
    """Only a peer socket closing during gloo's full-mesh connect is retried; a message naming neither is not."""
    closed = RuntimeError("Gloo connectFullMesh failed with [pair.cc:547] Connection closed by peer [127.0.0.1]:5")
    assert harness.is_transient_rendezvous(closed)
    assert harness.is_port_in_use(harness._TransientRendezvous(str(closed)))
    assert not harness.is_transient_rendezvous(RuntimeError("Gloo connectFullMesh failed with timeout"))
    assert not harness.is_transient_rendezvous(RuntimeError("Connection closed by peer"))
    assert not harness.is_port_in_use(RuntimeError("Unable to find address for: nonexistent_if0"))


PRELOAD_PROBE = """
import sys
import torch
import torch._C as C

called = []
for name in dir(C):
    if name.startswith("_cuda_") and callable(getattr(C, name)):
        def spy(*a, _name=name, _fn=getattr(C, name), **k):
            called.append(_name)
            return _fn(*a, **k)
        try:
            setattr(C, name, spy)
        except (AttributeError, TypeError):
            pass
for module in sys.argv[1:]:
    __import__(module)
import deepspeed_c.accelerator.real_accelerator as chosen
print(called, torch.cuda.is_initialized(), chosen._accelerator)
"""


def test_preloaded_deepspeed_c_modules_touch_no_cuda():
    """The rank server imports harness.PRELOADED_DSC before it forks ranks: importing them may neither call into
    CUDA (a rank forked from a server that had initialised CUDA could not use its GPU) nor choose the
    accelerator (each rank chooses under its own environment)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PRELOAD_PROBE, *harness.PRELOADED_DSC], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False None", out.stdout
