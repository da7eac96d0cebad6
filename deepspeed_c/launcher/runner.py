"""`deepspeed_c`: the job launcher, with DeepSpeed's `deepspeed` command-line flags.

    deepspeed_c --num_gpus 2 train.py --deepspeed_config ds_config.json
    deepspeed_c --hostfile hosts --include "worker-0:0,1@worker-1" train.py ...
    python -m deepspeed_c.launcher.runner --num_gpus 2 train.py ...   # same, without the console script

Resources come from a hostfile (`host slots=N` lines, default /job/hostfile), else from this
machine; `--include`/`--exclude` (`host:0,1@host2`), `--num_nodes` and `--num_gpus` select from
them. One node runs `python -m deepspeed_c.launcher.launch` here; several nodes go through
pdsh (default), OpenMPI, MVAPICH, MPICH, Intel MPI or Slurm (`--launcher`), or one launcher per
node with `--no_ssh --node_rank=N`. `.deepspeed_env` (NAME=VALUE lines, in ~ or the current
directory; DS_ENV_FILE renames it) is exported to every rank on every node.

Machines without GPUs: the slots are CPU processes. `--num_gpus N` (or `--num_accelerators N`)
starts N processes; the ranks see no CUDA device and use the gloo backend. With neither a
hostfile nor --num_gpus, a CPU machine gets one process per NUMA node (DeepSpeed's CPU rule).
GPUs are counted from the driver (/proc/driver/nvidia or `nvidia-smi -L`); the launcher never
initialises CUDA itself. With no hostfile and no resource flags, CUDA_VISIBLE_DEVICES=0,2
becomes `--include localhost:0,2`.

Exit status: the first failing rank's exit code (128 + N if it was killed by signal N), after
the other ranks have been stopped; Ctrl-C / SIGTERM reach every rank, and the launcher then
exits with 128 + the signal number.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

from deepspeed_c.launcher import constants
from deepspeed_c.launcher.constants import (DEEPSPEED_ENVIRONMENT_PATHS, DLTS_HOSTFILE, IMPI_LAUNCHER,  # noqa: F401
                                            MPICH_LAUNCHER, MVAPICH_LAUNCHER, OPENMPI_LAUNCHER, PDSH_LAUNCHER,
                                            PDSH_MAX_FAN_OUT, POLL_INTERVAL_S, SLURM_LAUNCHER, SUPPORTED_LAUNCHERS,
                                            TORCH_DISTRIBUTED_DEFAULT_PORT)
from deepspeed_c.launcher.environment import forwarded_variables, load_deepspeed_env
from deepspeed_c.launcher.multinode_runner import (IMPIRunner, MPICHRunner, MultiNodeRunner, MVAPICHRunner,
                                                   OpenMPIRunner, PDSHRunner, SlurmRunner)
from deepspeed_c.launcher.procs import SignalLatch, exit_code_of, spawn
# Re-exported: DeepSpeed's tests and tools reach these through deepspeed.launcher.runner.
from deepspeed_c.launcher.resources import (_parse_hostfile, apply_num_nodes_and_gpus, count_local_gpus,  # noqa: F401
                                            count_numa_nodes, encode_world_info, fetch_hostfile,
                                            parse_inclusion_exclusion, parse_node_config, parse_node_config_list,
                                            parse_resource_filter, visible_device_ids)
from deepspeed_c.utils.logging import logger

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
# Prefixes of the variables passed to every node of a multi-node launch (a user may extend the list).
EXPORT_ENVS = list(constants.EXPORT_ENVS)


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(prog=invoked if invoked in ("deepspeed", "deepspeed_c") else "deepspeed_c",
                                     description="deepspeed_c runner: launch multi-process, multi-node "
                                     "training jobs (DeepSpeed's `deepspeed` flags).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE,
                        help="Hostfile path (MPI style) defining the resource pool, e.g. 'worker-0 slots=4'.")
    parser.add_argument("-i", "--include", type=str, default="",
                        help="Resources to use: NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC=NAME[:SLOT[,SLOT ...]]. "
                        "Without :SLOT all slots of that host. Example: -i \"worker-0@worker-1:0,2\".")
    parser.add_argument("-e", "--exclude", type=str, default="",
                        help="Resources NOT to use; same format as --include, mutually exclusive with it. "
                        "Example: -e \"worker-1:0\".")
    parser.add_argument("--num_nodes", type=int, default=-1,
                        help="Total number of worker nodes to run on: the first N hosts of the hostfile.")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1,
                        help="Minimum number of nodes for elastic training (default 1).")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1,
                        help="Maximum number of nodes for elastic training (default num_nodes).")
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                        help="Number of GPUs per node (ids [0, N)); on a machine without GPUs, the number of "
                        "CPU processes per node.")
    parser.add_argument("--master_port", default=TORCH_DISTRIBUTED_DEFAULT_PORT, type=int,
                        help="Port used by PyTorch distributed for communication during training.")
    parser.add_argument("--master_addr", default="", type=str,
                        help="IP address of node 0; inferred via 'hostname -I' on it if not given.")
    parser.add_argument("--node_rank", default=-1, type=int,
                        help="ID of this node in [0, N). Only used with --no_ssh.")
    parser.add_argument("--launcher", default=PDSH_LAUNCHER, type=str,
                        help="Multi-node backend: pdsh, openmpi, mvapich, mpich, impi or slurm.")
    parser.add_argument("--launcher_args", default="", type=str,
                        help="Launcher-specific arguments, as one quoted string.")
    parser.add_argument("--module", action="store_true",
                        help="Run the user script as a Python module, like 'python -m'.")
    parser.add_argument("--no_python", action="store_true",
                        help="Execute the user script directly instead of through 'python'.")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="Do not pass --local_rank to the user script.")
    parser.add_argument("--no_ssh", action="store_true",
                        help="Launch on each node separately without ssh (give each its --node_rank).")
    parser.add_argument("--no_ssh_check", action="store_true",
                        help="Do not check passwordless ssh to the first host before a multi-node launch.")
    parser.add_argument("--force_multi", action="store_true",
                        help="Use the multi-node launcher even for a single (remote) node.")
    parser.add_argument("--save_pid", action="store_true",
                        help="Write the launcher pid to /tmp/<main-pid>.deepspeed, <main-pid> being this "
                        "process's pid.")
    parser.add_argument("--enable_each_rank_log", default="None", type=str,
                        help="Directory: redirect each rank's stdout and stderr to its own file there.")
    parser.add_argument("--autotuning", default="", choices=["tune", "run"], type=str,
                        help="Run the autotuner before the job (not built in deepspeed_c yet).")
    parser.add_argument("--comment", default="", type=str, help="Passed as --comment to srun (Slurm launcher).")
    parser.add_argument("--account", default="", type=str, help="Passed as --account to srun (Slurm launcher).")
    parser.add_argument("--elastic_training", action="store_true",
                        help="Enable elastic training (not built in deepspeed_c yet).")
    parser.add_argument("user_script", type=str, help="User script to launch, followed by its arguments.")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="Bind each rank to its own block of the host's cores.")
    parser.add_argument("--bind_core_list", type=str, default=None,
                        help="Cores to bind, comma separated numbers and ranges: 1,3-5,7 => [1,3,4,5,7]. "
                        "Default: all cores.")
    parser.add_argument("--ssh_port", type=int, default=None, help="SSH port for remote connections.")
    return parser.parse_args(args=args)


def _local_resource_pool() -> "OrderedDict[str, int]":
    gpus = count_local_gpus()
    if gpus > 0:
        return OrderedDict(localhost=gpus)
    slots = count_numa_nodes()
    logger.info(f"No GPU found on this machine: each slot is a CPU process using gloo ({slots} by default; "
                "--num_gpus N starts N)")
    return OrderedDict(localhost=slots)


def _ssh_base(port: int | None) -> list[str]:
    return ["ssh"] + (["-p", str(port)] if port is not None else [])


def _check_ssh(host: str, port: int | None, hostfile: str) -> None:
    cmd = _ssh_base(port)[:1] + ["-o", "PasswordAuthentication=no"] + _ssh_base(port)[1:] + [host, "hostname"]
    try:
        subprocess.check_call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        raise RuntimeError(f"Using hostfile at {hostfile} but host={host} was not reachable via ssh. If you are "
                           f"running with a single node please remove {hostfile} or setup passwordless ssh "
                           "(or pass --no_ssh_check).") from None


def _detect_master_addr(host: str, port: int | None) -> str:
    try:
        out = subprocess.check_output(_ssh_base(port) + [host, "hostname", "-I"], timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        raise RuntimeError("Unable to detect a master address via `hostname -I` on "
                           f"{host}, please give one with --master_addr") from err
    fields = out.decode("utf-8").split()
    if not fields:
        raise RuntimeError(f"`hostname -I` on {host} printed nothing, please give --master_addr")
    logger.info(f"Using IP address of {fields[0]} for node {host}")
    return fields[0]


def local_launch_cmd(args: argparse.Namespace, world_info_base64: str) -> list[str]:
    """The `deepspeed_c.launcher.launch` command for this node."""
    cmd = [sys.executable, "-u", "-m", "deepspeed_c.launcher.launch", f"--world_info={world_info_base64}",
           f"--master_addr={args.master_addr}", f"--master_port={args.master_port}"]
    if args.no_ssh:
        cmd.append(f"--node_rank={args.node_rank}")
    if args.no_python:
        cmd.append("--no_python")
    if args.module:
        cmd.append("--module")
    if args.no_local_rank:
        cmd.append("--no_local_rank")
    if args.save_pid:
        cmd += ["--save_pid", f"{os.getpid()}"]
    if args.enable_each_rank_log != "None":
        cmd.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if args.bind_cores_to_rank:
        cmd.append("--bind_cores_to_rank")
    if args.bind_core_list is not None:
        cmd.append(f"--bind_core_list={args.bind_core_list}")
    return cmd + [args.user_script] + list(args.user_args)


def make_multinode_runner(args: argparse.Namespace, world_info_base64: str,
                          resource_pool: Mapping[str, int]) -> MultiNodeRunner:
    if args.launcher == PDSH_LAUNCHER:
        return PDSHRunner(args, world_info_base64)
    classes = {OPENMPI_LAUNCHER: OpenMPIRunner, MVAPICH_LAUNCHER: MVAPICHRunner, MPICH_LAUNCHER: MPICHRunner,
               IMPI_LAUNCHER: IMPIRunner, SLURM_LAUNCHER: SlurmRunner}
    return classes[args.launcher](args, world_info_base64, resource_pool)


def _validate_launcher(args: argparse.Namespace) -> None:
    args.launcher = args.launcher.lower()
    if args.launcher == "jsrun":
        raise NotImplementedError("--launcher jsrun is not built in deepspeed_c; use one of "
                                  f"{', '.join(SUPPORTED_LAUNCHERS)}")
    if args.launcher not in SUPPORTED_LAUNCHERS:
        raise ValueError(f"Unknown launcher {args.launcher!r}; expected one of {', '.join(SUPPORTED_LAUNCHERS)}")


def _wait(proc: subprocess.Popen, latch: SignalLatch, on_signal: Callable[[int], None]) -> int:
    """Wait for the child; pass the first signal on, and SIGKILL the child on a second one."""
    handled = 0
    while True:
        try:
            return proc.wait(timeout=POLL_INTERVAL_S)
        except subprocess.TimeoutExpired:
            pass
        if latch.count > handled:
            if handled == 0:
                on_signal(latch.received)
            else:
                proc.kill()  # a second Ctrl-C: the launcher's own death signal stops the ranks
            handled = latch.count


def main(args: Sequence[str] | None = None) -> None:
    raw_args = args
    args = parse_args(args)
    _validate_launcher(args)
    if args.elastic_training:
        raise NotImplementedError("--elastic_training: elastic training is not built in deepspeed_c yet")

    explicit_hostfile = args.hostfile != DLTS_HOSTFILE
    if explicit_hostfile and not os.path.isfile(args.hostfile):
        raise FileNotFoundError(f"--hostfile {args.hostfile}: no such file")
    resource_pool = fetch_hostfile(args.hostfile)

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    pinned_include = ""  # the --include CUDA_VISIBLE_DEVICES became (the variable is then dropped)
    if not resource_pool and visible and count_local_gpus() > 0:
        detected = f"Detected CUDA_VISIBLE_DEVICES={visible}"
        if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
            print(f"{detected} but ignoring it because one or several of --include/--exclude/--num_gpus/"
                  "--num_nodes were given. To use CUDA_VISIBLE_DEVICES, pass none of them.")
        else:
            args.include = "localhost:" + ",".join(str(i) for i in visible_device_ids(visible))
            print(f"{detected}: setting --include={args.include}")
            pinned_include = args.include
        # The ranks get CUDA_VISIBLE_DEVICES from the launcher, in physical ids.
        del os.environ["CUDA_VISIBLE_DEVICES"]

    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include != "" or args.exclude != ""):
        raise ValueError("Cannot specify num_nodes/gpus with include/exclude")

    multi_node_exec = True
    if not resource_pool:
        resource_pool = _local_resource_pool()
        args.master_addr = args.master_addr or "127.0.0.1"
        multi_node_exec = False
    if not multi_node_exec and args.num_nodes > 1:
        raise ValueError("Num nodes is >1 but no extra nodes available via hostfile")

    active = parse_inclusion_exclusion(resource_pool, args.include, args.exclude)
    active = apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    if not active:
        raise ValueError(f"No resources left to launch on after --include={args.include!r} "
                         f"--exclude={args.exclude!r}")
    if args.launcher == SLURM_LAUNCHER and (args.include or args.exclude):
        SlurmRunner.validate_active_resources(active)
    if args.autotuning != "":
        # the tuner relaunches this launcher once per experiment, without --autotuning
        from deepspeed_c.autotuning.autotuner import main as autotune

        raw = list(sys.argv[1:] if raw_args is None else raw_args)
        if pinned_include:  # the experiments run without the variable: they keep the same GPUs explicitly
            raw = ["--include", pinned_include, *raw]
        sys.exit(autotune(args.autotuning, raw, args.user_script, sum(len(s) for s in active.values())))
    if args.no_ssh and not 0 <= args.node_rank < len(active):
        raise ValueError(f"Launching without ssh needs --node_rank in [0, {len(active)}), got {args.node_rank}")

    multi_node_exec = (args.force_multi or len(active) > 1) and not args.no_ssh
    first_host = next(iter(active))
    if multi_node_exec and not args.no_ssh_check:
        _check_ssh(first_host, args.ssh_port, args.hostfile)
    if not args.master_addr:
        if multi_node_exec:
            args.master_addr = _detect_master_addr(first_host, args.ssh_port)
        elif len(active) == 1 and not args.no_ssh:
            args.master_addr = "127.0.0.1"  # one host, launched right here
        else:
            raise ValueError("--no_ssh with several nodes needs --master_addr (the address of node 0)")

    world_info_base64 = encode_world_info(active)
    env = os.environ.copy()
    env_file = load_deepspeed_env(DEEPSPEED_ENVIRONMENT_PATHS, DEEPSPEED_ENVIRONMENT_NAME)
    if env_file:
        logger.info(f"{DEEPSPEED_ENVIRONMENT_NAME}: exporting {', '.join(env_file)}")

    kill_cmd: list[str] | None = None
    if not multi_node_exec:
        env.update(env_file)
        cmd = local_launch_cmd(args, world_info_base64)
    else:
        runner = make_multinode_runner(args, world_info_base64, resource_pool)
        if not runner.backend_exists():
            raise RuntimeError(f"launcher '{args.launcher}' not installed.")
        cwd = os.path.abspath(".")
        env["PYTHONPATH"] = cwd + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for key, value in forwarded_variables(env, EXPORT_ENVS).items():
            runner.add_export(key, value)
        for key, value in env_file.items():
            runner.add_export(key, value)
        if isinstance(runner, PDSHRunner):
            cmd, kill_cmd, env = runner.get_cmd(env, active)
        else:
            cmd = runner.get_cmd(env, active)
    logger.info(f"cmd = {' '.join(shlex.quote(c) for c in cmd)}")

    latch = SignalLatch()
    try:
        # Same process group as this runner, so a terminal's Ctrl-C reaches it directly too; if this
        # runner is SIGKILLed, SIGTERM tells the launcher to stop its ranks.
        proc = spawn(cmd, env, new_session=False, death_signal=signal.SIGTERM)

        def on_signal(sig: int) -> None:
            if kill_cmd is None:
                proc.send_signal(sig)
            else:  # pdsh: stop the remote launchers, which stop their ranks
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGTERM)
                subprocess.run(kill_cmd, env=env, timeout=60, check=False)

        code = _wait(proc, latch, on_signal)
        received = latch.received
    finally:
        latch.restore()
    status = exit_code_of(code)
    if received is not None and status == 0:
        status = 128 + received
    # The ranks printed their own errors; just pass the status to the caller (usually a shell).
    if status != 0:
        sys.exit(status)


if __name__ == "__main__":
    main()
