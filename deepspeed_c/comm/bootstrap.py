"""init_distributed: bring up the default process group the way DeepSpeed does.

Where rank, size and rendezvous come from, in order: the environment our launcher and torchrun
set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); Open MPI's OMPI_COMM_WORLD_*; and
with neither, a world of one on localhost with a free port, so a plain `python train.py` runs.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from deepspeed_c.comm import comm as _comm
from deepspeed_c.comm.backend import TorchBackend
from deepspeed_c.comm.constants import TORCH_DISTRIBUTED_DEFAULT_PORT, default_pg_timeout, timeout_from_env
from deepspeed_c.utils.logging import logger

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
LOCALHOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


# the MASTER_PORT this process chose itself for a world of one (None: the launcher's or the user's)
_auto_port: Optional[str] = None


def _pick_auto_port() -> None:
    global _auto_port
    _auto_port = str(_free_port())
    os.environ["MASTER_PORT"] = _auto_port


def _own_single_port() -> bool:
    """Whether the environment's MASTER_PORT is one this process picked for a world of one: a port found free is
    only reserved once the store listens on it, so another process may take it first (then a fresh one is fine)."""
    return _auto_port is not None and os.environ.get("MASTER_PORT") == _auto_port and \
        os.environ.get("WORLD_SIZE") == "1"


def default_backend() -> str:
    """The accelerator's backend; nccl with CUDA, gloo without, while the accelerator is absent."""
    try:
        from deepspeed_c.accelerator import get_accelerator

        return str(get_accelerator().communication_backend_name())
    except (ImportError, AttributeError):
        return "nccl" if torch.cuda.is_available() else "gloo"


def _set_default(name: str, value: Any) -> None:
    if os.environ.get(name, "") == "":
        os.environ[name] = str(value)


def _mpi_master_addr(verbose: bool) -> Optional[str]:
    """Rank 0's address through mpi4py, when it is installed."""
    try:
        from mpi4py import MPI  # type: ignore[import-not-found]
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    addr = None
    if comm.Get_rank() == 0:
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = LOCALHOST
    addr = comm.bcast(addr, root=0)
    if verbose:
        logger.info(f"Discovered master address {addr} through mpi4py")
    return addr


def mpi_discovery(distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True) -> None:
    """Map Open MPI's OMPI_COMM_WORLD_* onto the variables torch.distributed reads."""
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ["RANK"])
    if os.environ.get("MASTER_ADDR", "") == "":
        local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "0") or 0)
        addr = LOCALHOST if size == 1 or local_size == size else _mpi_master_addr(verbose)
        if addr is None:
            raise RuntimeError("init_distributed: an Open MPI job over several nodes needs MASTER_ADDR set to rank 0's "
                               "address (or mpi4py installed to discover it)")
        os.environ["MASTER_ADDR"] = addr
    _set_default("MASTER_PORT", distributed_port)
    if verbose:
        logger.info(f"Discovered MPI settings of world_rank={os.environ['RANK']}, local_rank={os.environ['LOCAL_RANK']}, "
                    f"world_size={os.environ['WORLD_SIZE']}, master_addr={os.environ['MASTER_ADDR']}, "
                    f"master_port={os.environ['MASTER_PORT']}")


# (rank, world size, local rank) variables of the other launchers our multi-node runners use;
# they export MASTER_ADDR/MASTER_PORT themselves.
_LAUNCHER_ENV_FAMILIES = (
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun
)


def _map_launcher_env() -> None:
    if os.environ.get("RANK", "") != "":
        return
    for rank_var, size_var, local_var in _LAUNCHER_ENV_FAMILIES:
        if os.environ.get(rank_var, "") != "" and os.environ.get(size_var, "") != "":
            os.environ["RANK"] = os.environ[rank_var]
            os.environ["WORLD_SIZE"] = os.environ[size_var]
            os.environ.setdefault("LOCAL_RANK", os.environ.get(local_var, os.environ[rank_var]))
            return


def _fill_env(auto_mpi_discovery: bool, distributed_port: int, verbose: bool, rank: int, world_size: int) -> None:
    if all(os.environ.get(v, "") != "" for v in REQUIRED_ENV):
        return
    _map_launcher_env()
    if auto_mpi_discovery and os.environ.get("OMPI_COMM_WORLD_SIZE", "") != "" and os.environ.get("RANK", "") == "":
        if verbose:
            logger.info("Not using the DeepSpeed or dist launchers, attempting to detect MPI environment...")
        mpi_discovery(distributed_port=distributed_port, verbose=verbose)
        return
    # Partial or no launcher environment: fill the gaps. With nothing at all this is a world of one.
    _set_default("RANK", rank if rank >= 0 else 0)
    _set_default("WORLD_SIZE", world_size if world_size >= 0 else 1)
    single = int(os.environ["WORLD_SIZE"]) == 1
    # without a launcher every rank is assumed to be on this node
    _set_default("LOCAL_RANK", 0 if single else os.environ["RANK"])
    _set_default("MASTER_ADDR", LOCALHOST)
    if single and os.environ.get("MASTER_PORT", "") == "":
        _pick_auto_port()
    _set_default("MASTER_PORT", distributed_port)
    if verbose and single:
        logger.info(f"No launcher environment found; initializing a world of one on "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta = default_pg_timeout, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed's default group (once) and deepspeed_c.comm's backend.

    dist_backend: torch backend name; None asks the accelerator (nccl on CUDA, gloo on CPU).
    timeout: the process-group timeout; the default is DEEPSPEED_TIMEOUT minutes, else 30.
    config: a DeepSpeed config (dict or typed) whose comms_logger section configures the logger.
    rank, world_size: for init methods (tcp://, file://) that need them stated.
    """
    if config is not None:
        _comm.configure(deepspeed_config=config)

    if dist_init_required is None:
        dist_init_required = not dist.is_initialized()

    if dist.is_initialized():
        # someone (the user, accelerate, a harness) already built the group: adopt it
        if _comm.cdb is None or not _comm.cdb.is_initialized():
            _comm.cdb = TorchBackend(dist_backend, timeout, init_method)
        if verbose and dist.get_rank() == 0:
            logger.info("Distributed backend already initialized")
        return

    if dist_init_required is False:
        raise AssertionError("Distributed backend is not initialized. Please set dist_init_required to True or "
                             "initialize before calling deepspeed.initialize()")

    if timeout is default_pg_timeout:
        timeout = timeout_from_env()
    if not isinstance(timeout, timedelta):
        raise TypeError(f"init_distributed: timeout must be a datetime.timedelta, got {type(timeout).__name__}")

    env_init = init_method is None or init_method.startswith("env://")
    if env_init:
        if _own_single_port():  # a port picked for an earlier group of one (since destroyed): pick afresh
            _pick_auto_port()
        _fill_env(auto_mpi_discovery, distributed_port, verbose, rank, world_size)

    backend = dist_backend if dist_backend is not None else default_backend()
    if verbose and int(os.environ.get("RANK", "0") or 0) == 0:
        logger.info(f"Initializing TorchBackend in DeepSpeed with backend {backend}")
    for attempt in range(3):
        try:
            _comm.cdb = TorchBackend(backend, timeout, init_method, rank, world_size)
            break
        except RuntimeError as e:  # torch's DistNetworkError: our own free port taken meanwhile by another process
            if not (env_init and _own_single_port() and "EADDRINUSE" in str(e)) or attempt == 2:
                raise
            _pick_auto_port()
