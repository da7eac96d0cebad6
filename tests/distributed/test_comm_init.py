"""init_distributed in real processes: from the launcher/torchrun variables, from Open MPI's
OMPI_COMM_WORLD_* (with DEEPSPEED_TIMEOUT and distributed_port), and with no launcher at all
(a world of one on a free localhost port)."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _pg_timeout() -> timedelta:
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    return dist.group.WORLD._get_backend(dev).options._timeout


def _sum_of_ranks() -> float:
    import torch

    import deepspeed_c.comm as dc

    dev = torch.device("cuda", dc.get_local_rank()) if dc.get_backend() == "nccl" else torch.device("cpu")
    t = torch.full((1, ), float(dc.get_rank()), dtype=torch.float64, device=dev)
    dc.all_reduce(t)
    return t.item()


def _from_launcher_env(rank: int, w: int) -> dict:
    import torch.distributed as dist

    import deepspeed_c.comm as dc

    assert not dist.is_initialized()
    dc.init_distributed(verbose=False)
    from deepspeed_c.comm.bootstrap import default_backend

    out = {"rank": dc.get_rank(), "world": dc.get_world_size(), "local": dc.get_local_rank(),
           "backend": dc.get_backend(), "default": default_backend(), "sum": _sum_of_ranks(),
           "timeout": _pg_timeout()}
    dc.init_distributed(verbose=False)  # a second call adopts the live group instead of failing
    dc.init_distributed(dist_init_required=False, verbose=False)
    out["same_after_reinit"] = dc.get_world_size() == w
    dc.destroy_process_group()
    out["destroyed"] = not dc.is_initialized() and dc.cdb is None
    return out


def _from_mpi_env(rank: int, w: int) -> dict:
    import deepspeed_c.comm as dc

    port = int(os.environ["MASTER_PORT"])
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    os.environ.update({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(w),
                       "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(w),
                       "DEEPSPEED_TIMEOUT": "3"})
    dc.init_distributed(distributed_port=port, verbose=False)
    out = {"rank": dc.get_rank(), "world": dc.get_world_size(), "local": dc.get_local_rank(),
           "sum": _sum_of_ranks(), "timeout": _pg_timeout(), "addr": os.environ["MASTER_ADDR"],
           "port": int(os.environ["MASTER_PORT"]), "wanted_port": port}
    dc.destroy_process_group()
    return out


def test_init_from_launcher_env():
    w = 2
    res = run_distributed(_from_launcher_env, w, backend="none", env={"DEEPSPEED_TIMEOUT": ""})
    for rank, r in enumerate(res):
        assert (r["rank"], r["world"], r["local"], r["backend"]) == (rank, w, rank, r["default"])
        assert r["sum"] == w * (w - 1) / 2
        assert r["timeout"] == timedelta(minutes=30)  # DeepSpeed's default
        assert r["same_after_reinit"] and r["destroyed"]


def test_init_from_open_mpi_env_with_timeout():
    w = 2
    res = run_distributed(_from_mpi_env, w, backend="none")
    for rank, r in enumerate(res):
        assert (r["rank"], r["world"], r["local"]) == (rank, w, rank)
        assert r["sum"] == w * (w - 1) / 2
        assert r["timeout"] == timedelta(minutes=3)  # DEEPSPEED_TIMEOUT, set after import
        assert r["addr"] == "127.0.0.1" and r["port"] == r["wanted_port"]


def _from_slurm_or_mvapich_env(rank: int, w: int, family: str) -> dict:
    import deepspeed_c.comm as dc

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    names = {"slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
             "mvapich": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK")}[family]
    os.environ.update(dict(zip(names, (str(rank), str(w), str(rank)))))
    dc.init_distributed(verbose=False)
    out = (dc.get_rank(), dc.get_world_size(), dc.get_local_rank(), _sum_of_ranks())
    dc.destroy_process_group()
    return out


def test_init_from_slurm_and_mvapich_env():
    for family in ("slurm", "mvapich"):
        res = run_distributed(_from_slurm_or_mvapich_env, 2, args=(family,), backend="none")
        assert res == [(0, 2, 0, 1.0), (1, 2, 1, 1.0)], family


def world_of_one_main() -> None:
    import torch.distributed as dist

    import deepspeed_c.comm as dc

    try:
        dc.init_distributed(dist_init_required=False, verbose=False)
    except AssertionError as err:
        assert "not initialized" in str(err)
    else:
        raise AssertionError("dist_init_required=False without a group must fail")
    dc.init_distributed(verbose=False)
    assert dist.is_initialized() and dc.get_world_size() == 1 and dc.get_rank() == 0 and dc.get_local_rank() == 0
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) != 29500
    assert _sum_of_ranks() == 0.0
    assert _pg_timeout() == timedelta(minutes=7)
    dc.destroy_process_group()
    print("WORLD_OF_ONE_OK")


def test_world_of_one_without_launcher():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("OMPI_")}
    env.update({"OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "7", "PYTHONPATH": ROOT})
    proc = subprocess.run([sys.executable, "-c", "from tests.distributed.test_comm_init import world_of_one_main as m; m()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WORLD_OF_ONE_OK" in proc.stdout
