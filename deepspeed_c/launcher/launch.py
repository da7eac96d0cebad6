"""Per-node launcher: starts one process per local slot and watches them.

    python -m deepspeed_c.launcher.launch --world_info=<base64 json> --node_rank=0 \\
        --master_addr=127.0.0.1 --master_port=29500 train.py --deepspeed_config ds.json

The runner (`deepspeed_c`) builds this command for each node. Every rank gets RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_SIZE (and torchrun's LOCAL_WORLD_SIZE), MASTER_ADDR, MASTER_PORT, CROSS_RANK
(the node rank), CROSS_SIZE (the node count) and, unless --no_local_rank, `--local_rank=N` as its
first script argument. On a node with NVIDIA GPUs, CUDA_VISIBLE_DEVICES is the node's slot list
(so slot ids are GPU ids). On a node without GPUs the slots are CPU processes: no
CUDA_VISIBLE_DEVICES is set, the ranks pick gloo, and OMP_NUM_THREADS, when unset, becomes the
node's usable cores divided by the local rank count so that ranks do not oversubscribe cores.

Faults: if a rank exits non-zero or is killed, the other ranks get SIGTERM, then SIGKILL after
a short grace (all within 5 seconds), and the launcher exits with that rank's code (128 + N for
a rank killed by signal N). SIGINT or SIGTERM to the launcher is passed to every rank the same
way; the launcher then exits with 128 + the signal number. Ranks run in their own process
groups with a parent-death signal, so nothing they start outlives the launcher.

Port: on node 0 the launcher checks that --master_port is free before starting any rank; a port
in use ends the launch with exit code 1 and a message naming the port (see port_check.py).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import IO, Sequence

from deepspeed_c.launcher.constants import (CROSS_RANK, CROSS_SIZE, PID_FILE_BASEPATH, POLL_INTERVAL_S,
                                            TORCH_DISTRIBUTED_DEFAULT_PORT)
from deepspeed_c.launcher import numa
from deepspeed_c.launcher.port_check import MasterPortInUseError, check_master_port
from deepspeed_c.launcher.procs import SignalLatch, exit_code_of, group_alive, spawn, stop_ranks
from deepspeed_c.launcher.resources import count_local_gpus, decode_world_info
from deepspeed_c.utils.logging import logger

LAUNCH_PID_FILE = os.path.join(PID_FILE_BASEPATH, "deepspeed_c_launch_{launch_id}.pid")


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="deepspeed_c per-node launcher: starts one process per local "
                                     "slot of a distributed job")
    parser.add_argument("--node_rank", type=int, default=0, help="Rank of this node in the world_info host order.")
    parser.add_argument("--master_addr", default="127.0.0.1", type=str,
                        help="Address of the node hosting rank 0 (127.0.0.1 for a single node).")
    parser.add_argument("--master_port", default=TORCH_DISTRIBUTED_DEFAULT_PORT, type=int,
                        help="Free port on the master node for torch.distributed's rendezvous.")
    parser.add_argument("--world_info", default="None", type=str, help="world info base64 encoded dictionary")
    parser.add_argument("--module", action="store_true",
                        help="Run the training script as a Python module, like 'python -m'.")
    parser.add_argument("--no_python", action="store_true",
                        help="Execute the training script directly instead of through 'python'.")
    parser.add_argument("--enable_elastic_training", action="store_true", help="Enable elastic training support.")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="Min number of nodes in elastic training.")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="Max number of nodes in elastic training.")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="Do not pass --local_rank to the training script.")
    parser.add_argument("--save_pid", type=int, default=0,
                        help="Main launching process pid: write this launcher's pid to /tmp/<pid>.deepspeed.")
    parser.add_argument("--enable_each_rank_log", default="None", type=str,
                        help="Directory: redirect each rank's stdout and stderr to its own log file there.")
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="Bind each rank to its own block of cores of the host.")
    parser.add_argument("--bind_core_list", type=str, default=None,
                        help="Cores to bind to, e.g. 1,3-5,7 => [1,3,4,5,7]; default: all cores.")
    parser.add_argument("--log_level", type=str, default="info",
                        choices=["debug", "info", "warning", "error", "critical"], help="Launcher log level.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Aliases --log_level error.")
    parser.add_argument("--launch_id", type=str, default="",
                        help="(internal) id of a multi-node launch: this launcher writes its pid to "
                        "/tmp/deepspeed_c_launch_<id>.pid so the runner can stop it remotely.")
    parser.add_argument("training_script", type=str, help="The training program, followed by its arguments.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args=args)


def _rank_command(args: argparse.Namespace, local_rank: int, prefix: Sequence[str]) -> list[str]:
    cmd = list(prefix)
    if args.no_python:
        if args.module:
            raise ValueError("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
    else:
        cmd += [sys.executable, "-u"] + (["-m"] if args.module else [])
    cmd.append(args.training_script)
    if not args.no_local_rank:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(args.training_script_args)


def _write_pid_file(path: str) -> str:
    if os.path.isfile(path):
        raise FileExistsError(f"pid file {path} already exists; another launch with the same id is running "
                              "or a previous one was killed: remove the file and retry")
    with open(path, "w") as fd:
        fd.write(f"{os.getpid()}")
    return path


def main(args: Sequence[str] | None = None) -> int:
    ns = parse_args(args)
    logger.setLevel("ERROR" if ns.quiet else ns.log_level.upper())
    if ns.enable_elastic_training:
        raise NotImplementedError("--enable_elastic_training: elastic training is not built in deepspeed_c yet; "
                                  "launch without --elastic_training")
    if ns.world_info == "None":
        raise ValueError("--world_info is required (base64-encoded JSON {host: [slot, ...]})")
    world_info = decode_world_info(ns.world_info)
    nodes = list(world_info)
    if not 0 <= ns.node_rank < len(nodes):
        raise ValueError(f"--node_rank={ns.node_rank} is outside [0, {len(nodes)}) for hosts {nodes}")
    local_slots = world_info[nodes[ns.node_rank]]
    num_local = len(local_slots)
    if num_local == 0:
        raise ValueError(f"node {nodes[ns.node_rank]!r} has no slots in --world_info")
    first_rank = sum(len(world_info[n]) for n in nodes[:ns.node_rank])
    world_size = sum(len(slots) for slots in world_info.values())
    logger.info(f"WORLD INFO DICT: {dict(world_info)}")
    logger.info(f"nnodes={len(nodes)}, num_local_procs={num_local}, node_rank={ns.node_rank}")

    if ns.node_rank == 0:  # rank 0 (first_rank 0) serves the rendezvous store from this node
        try:
            check_master_port(ns.master_port, ns.master_addr)
        except MasterPortInUseError as err:
            print(err, file=sys.stderr, flush=True)  # the message is the whole story: no traceback
            return 1
    env = os.environ.copy()
    gpus = count_local_gpus()
    if gpus > 0:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in local_slots)
        logger.info(f"Setting CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
    elif "OMP_NUM_THREADS" not in env and not ns.bind_cores_to_rank:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, usable // num_local))
        logger.info(f"No GPU on this node: {num_local} CPU processes (gloo), "
                    f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    env.update({"MASTER_ADDR": ns.master_addr, "MASTER_PORT": str(ns.master_port), "WORLD_SIZE": str(world_size),
                CROSS_RANK: str(ns.node_rank), CROSS_SIZE: str(len(nodes)), "LOCAL_SIZE": str(num_local),
                "LOCAL_WORLD_SIZE": str(num_local)})

    pid_files: list[str] = []
    log_files: list[IO] = []
    procs: list[subprocess.Popen] = []
    latch = SignalLatch()
    try:
        if ns.save_pid:
            print(f"launcher pid: {os.getpid()}")
            pid_files.append(_write_pid_file(os.path.join(PID_FILE_BASEPATH, f"{ns.save_pid}.deepspeed")))
        if ns.launch_id:
            pid_files.append(_write_pid_file(LAUNCH_PID_FILE.format(launch_id=ns.launch_id)))
        log_dir = None if ns.enable_each_rank_log == "None" else ns.enable_each_rank_log
        if log_dir is not None:
            if os.path.isfile(log_dir):
                raise ValueError(f"--enable_each_rank_log={log_dir} should be a directory, not a file.")
            os.makedirs(log_dir, exist_ok=True)
        stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())

        for local_rank in range(num_local):
            rank = first_rank + local_rank
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(local_rank))
            prefix: list[str] = []
            affinity = None
            if ns.bind_cores_to_rank:
                per_rank, cores = numa.cores_for_rank(ns.bind_core_list, num_local, local_rank)
                rank_env["OMP_NUM_THREADS"] = str(per_rank)
                prefix = numa.working_numactl_prefix(cores) or []
                if not prefix:
                    if local_rank == 0:
                        logger.warning("numactl is not installed or not permitted here: binding cores with "
                                       "sched_setaffinity, without NUMA memory binding")
                    affinity = cores
            cmd = _rank_command(ns, local_rank, prefix)
            out = None
            if log_dir is not None:
                out = open(os.path.join(log_dir, f"{stamp}_rank{rank}.log"), "w")
                log_files.append(out)
            if latch.received is not None:
                break
            proc = spawn(cmd, rank_env, new_session=True, death_signal=signal.SIGKILL, stdout=out,
                         stderr=subprocess.STDOUT if out is not None else None, cpu_affinity=affinity)
            procs.append(proc)
            logger.info(f"process {proc.pid} spawned with command: {cmd}")
        return _watch(procs, latch)
    except BaseException:
        if procs:
            stop_ranks(procs)
        raise
    finally:
        latch.restore()
        for fd in log_files:
            fd.close()
        for path in pid_files:
            try:
                os.remove(path)
            except OSError:
                pass


def _watch(procs: list[subprocess.Popen], latch: SignalLatch) -> int:
    """Wait for every rank; stop the rest on the first failure or on a signal to the launcher."""
    rank_of = {p.pid: i for i, p in enumerate(procs)}
    alive = list(procs)
    while alive:
        if latch.received is not None:
            sig = latch.received
            logger.info(f"launcher received {signal.Signals(sig).name}, passing it to {len(alive)} ranks")
            stop_ranks(procs, first_signal=sig)
            return 128 + sig
        for proc in list(alive):
            code = proc.poll()
            if code is None:
                continue
            alive.remove(proc)
            if code != 0:
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                logger.error(f"rank process {proc.pid} (local rank {rank_of[proc.pid]}) {how}; "
                             f"stopping the other ranks")
                stop_ranks(procs)
                return exit_code_of(code)
            logger.info(f"Process {proc.pid} exits successfully.")
        if alive:
            time.sleep(POLL_INTERVAL_S)
    # The script finished cleanly; whatever it left running in its process group goes too.
    if any(group_alive(p.pid) for p in procs):
        stop_ranks(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
