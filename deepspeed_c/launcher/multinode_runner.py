"""Command lines for multi-node launches: pdsh, OpenMPI, MVAPICH, MPICH, Intel MPI and Slurm.

Each runner turns the parsed runner arguments, the encoded world info and the active resources
into the argv that the runner starts on this machine. pdsh runs `deepspeed_c.launcher.launch` on
every node (which then starts the ranks); the MPI and Slurm runners start the ranks themselves,
one process per slot, and the ranks read their rank from the MPI/Slurm environment
(OMPI_COMM_WORLD_*, PMI_*, SLURM_PROCID, ...) or, for MPICH/Intel MPI, from RANK/LOCAL_RANK set
per rank on the command line. Nothing here runs ssh: `get_cmd` only builds lists of strings.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from abc import ABC, abstractmethod
from typing import Any, Mapping, MutableMapping

from deepspeed_c.launcher.constants import MVAPICH_TMP_HOSTFILE, PDSH_MAX_FAN_OUT
from deepspeed_c.launcher.launch import LAUNCH_PID_FILE
from deepspeed_c.launcher.numa import get_numactl_cmd

Resources = Mapping[str, list[int]]


def as_slot_lists(resources: Mapping[str, Any]) -> dict[str, list[int]]:
    """Host -> slot ids. DeepSpeed's callers pass either that or its resource pool form, host -> slot
    count (its runners read only the hosts and the counts), so both are accepted."""
    out: dict[str, list[int]] = {}
    for host, slots in resources.items():
        if isinstance(slots, int) and not isinstance(slots, bool):
            if slots < 0:
                raise ValueError(f"host {host!r}: slot count must be >= 0, got {slots}")
            out[host] = list(range(slots))
        else:
            out[host] = [int(s) for s in slots]
    return out


def _python_exec(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        if args.module:
            raise ValueError("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
        return []
    return [sys.executable, "-u"] + (["-m"] if args.module else [])


def _slots_per_node(resources: Resources, launcher: str) -> tuple[int, int]:
    counts = [len(slots) for slots in resources.values()]
    if not counts:
        raise ValueError(f"{launcher}: no active resources to launch on")
    if any(c != counts[0] for c in counts):
        raise ValueError(f"{launcher} requires the same number of devices per node, got "
                         f"{dict((h, len(s)) for h, s in resources.items())}")
    return sum(counts), counts[0]


class MultiNodeRunner(ABC):
    """Base: holds the args, the world info and the variables exported to every rank."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether the backend's tools are installed on this machine."""

    @abstractmethod
    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources):
        """The command that starts the job on every node."""

    def add_export(self, key: str, var: str) -> None:
        self.exports[key.strip()] = str(var).strip()

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        return self.__class__.__name__

    def validate_args(self) -> None:
        """Reject arguments this backend cannot honour."""

    @staticmethod
    def validate_active_resources(active_resources: Resources) -> None:
        """Reject resource filters this backend cannot express (only Slurm has limits)."""

    def _reject_filters(self) -> None:
        if self.args.include != "" or self.args.exclude != "":
            raise ValueError(f"{self.name} backend does not support worker include/exclusion")
        if self.args.num_nodes != -1 or self.args.num_gpus != -1:
            raise ValueError(f"{self.name} backend does not support limiting num nodes/gpus")

    def _rendezvous_exports(self) -> list[tuple[str, str]]:
        pairs = []
        if self.args.master_addr:
            pairs.append(("MASTER_ADDR", str(self.args.master_addr)))
        pairs.append(("MASTER_PORT", str(self.args.master_port)))
        return pairs


class PDSHRunner(MultiNodeRunner):
    """pdsh starts `deepspeed_c.launcher.launch` on every host; pdsh replaces %n with the node rank."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, launch_id: str | None = None) -> None:
        super().__init__(args, world_info_base64)
        self.launch_id = launch_id if launch_id is not None else f"{os.getpid()}"

    def backend_exists(self) -> bool:
        return shutil.which("pdsh") is not None

    def parse_user_args(self) -> list[str]:
        # pdsh joins its arguments into one remote shell command line: quote each argument.
        return [shlex.quote(arg) for arg in self.args.user_args]

    @property
    def name(self) -> str:
        return "pdsh"

    def _export_line(self) -> str:
        # Double quotes, as DeepSpeed writes them: $VAR in a value still expands on the node.
        def q(value: str) -> str:
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return "".join(f"export {k}={q(v)}; " for k, v in self.exports.items())

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources):
        active_resources = as_slot_lists(active_resources)
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if getattr(self.args, "ssh_port", None) is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = (environment.get("PDSH_SSH_ARGS_APPEND", "") +
                                                   f" -p {self.args.ssh_port}").strip()
        workers = ",".join(active_resources.keys())
        pdsh_cmd = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", workers] + shlex.split(self.args.launcher_args)

        launch = [
            self._export_line(), f"cd {shlex.quote(os.path.abspath('.'))};", shlex.quote(sys.executable), "-u", "-m",
            "deepspeed_c.launcher.launch", f"--world_info={self.world_info_base64}", "--node_rank=%n",
            f"--master_addr={self.args.master_addr}", f"--master_port={self.args.master_port}",
            f"--launch_id={self.launch_id}"
        ]
        if self.args.no_python:
            launch.append("--no_python")
        if self.args.module:
            launch.append("--module")
        if self.args.no_local_rank:
            launch.append("--no_local_rank")
        if self.args.save_pid:
            launch += ["--save_pid", f"{os.getpid()}"]
        if self.args.enable_each_rank_log != "None":
            launch.append(f"--enable_each_rank_log={shlex.quote(self.args.enable_each_rank_log)}")
        if self.args.bind_cores_to_rank:
            launch.append("--bind_cores_to_rank")
        if self.args.bind_core_list is not None:
            launch.append(f"--bind_core_list={self.args.bind_core_list}")
        cmd = pdsh_cmd + launch + [shlex.quote(self.user_script)] + self.user_arguments

        # Stop exactly the launchers of this job: each wrote its pid to a file named by launch id.
        pid_file = LAUNCH_PID_FILE.format(launch_id=self.launch_id)
        kill_cmd = pdsh_cmd + [f"test -f {pid_file} && kill -TERM $(cat {pid_file})"]
        return cmd, kill_cmd, environment


class OpenMPIRunner(MultiNodeRunner):
    """mpirun over the hostfile; ranks read OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool
        self.add_export("UCX_TLS", "tcp")

    def backend_exists(self) -> bool:
        return shutil.which("ompi_info") is not None

    @property
    def name(self) -> str:
        return "openmpi"

    def validate_args(self) -> None:
        self._reject_filters()

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        active_resources = as_slot_lists(active_resources)
        total = sum(len(s) for s in active_resources.values())
        launcher_args = shlex.split(self.args.launcher_args)
        # eth0 unless the user chose the TCP interface in --launcher_args.
        btl_tcp = ["--mca", "btl_tcp_if_include", "eth0"]
        for i in range(len(launcher_args) - 1):
            if launcher_args[i] in ("-mca", "--mca") and launcher_args[i + 1] == "btl_tcp_if_include":
                btl_tcp = []
                break
        mpirun = ["mpirun", "-n", f"{total}", "-hostfile", f"{self.args.hostfile}", "--mca", "btl", "^openib"
                  ] + btl_tcp + launcher_args
        exports: list[str] = []
        for k, v in list(self.exports.items()) + self._rendezvous_exports():
            exports += ["-x", f"{k}={v}"]
        return mpirun + exports + _python_exec(self.args) + [self.user_script] + self.user_arguments


class MVAPICHRunner(MultiNodeRunner):
    """MVAPICH2-GDR's mpirun with a generated hostfile of the active hosts."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int],
                 cuda: bool | None = None) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool
        self.add_export("MV2_SMP_USE_CMA", "0")  # the CMA kernel module is missing on Ubuntu
        self.add_export("MV2_DEBUG_SHOW_BACKTRACE", "1")
        if cuda if cuda is not None else _has_nvidia_gpu():
            self.add_export("MV2_USE_CUDA", "1")
        self.add_export("MV2_SUPPORT_DL", "1")
        self.add_export("MV2_ENABLE_AFFINITY", "0")  # needed for MPI_THREAD_MULTIPLE
        self.add_export("MV2_INTER_ALLGATHER_TUNING", "5")
        self.add_export("MV2_CUDA_USE_NAIVE", "0")
        self.hostfile_path = MVAPICH_TMP_HOSTFILE

    def backend_exists(self) -> bool:
        if shutil.which("mpiname") is None:
            warnings.warn("mpiname does not exist, mvapich is not installed properly")
            return False
        name = subprocess.check_output(["mpiname"]).decode("utf-8").strip()
        if "MVAPICH2-GDR" not in name:
            warnings.warn(f"Expected MVAPICH2-GDR as return for mpiname but received {name}")
            return False
        return True

    @property
    def name(self) -> str:
        return "mvapich"

    def validate_args(self) -> None:
        self._reject_filters()

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        active_resources = as_slot_lists(active_resources)
        total, per_node = _slots_per_node(active_resources, self.name)
        with open(self.hostfile_path, "w") as fd:
            fd.writelines(f"{host}\n" for host in active_resources)
        mpirun = ["mpirun", "-np", f"{total}", "-ppn", f"{per_node}", "--hostfile", self.hostfile_path
                  ] + shlex.split(self.args.launcher_args)
        exports: list[str] = []
        for k, v in list(self.exports.items()) + self._rendezvous_exports():
            exports += ["-env", f"{k}={v}"]
        return mpirun + exports + _python_exec(self.args) + [self.user_script] + self.user_arguments


class _HydraRunner(MultiNodeRunner):
    """MPICH and Intel MPI (both Hydra): one `-n 1` block per rank with its RANK and LOCAL_RANK."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None

    def validate_args(self) -> None:
        self._reject_filters()

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        active_resources = as_slot_lists(active_resources)
        total, per_node = _slots_per_node(active_resources, self.name)
        # No global -n: the per-rank "-n 1" blocks below give the process count.
        head = ["mpirun", "-ppn", f"{per_node}"] + shlex.split(self.args.launcher_args)
        genv: list[str] = []
        for k, v in self.exports.items():
            genv += ["-genv", k, v]
        if self.args.bind_cores_to_rank:
            cores_per_rank, _ = get_numactl_cmd(self.args.bind_core_list, per_node, 0)
            genv += ["-genv", "OMP_NUM_THREADS", str(cores_per_rank)]
        for k, v in self._rendezvous_exports():
            genv += ["-genv", k, v]
        genv += ["-genv", "WORLD_SIZE", str(total), "-genv", "LOCAL_SIZE", str(per_node)]
        if self.name == "impi":
            genv += ["-genv", "I_MPI_PIN", "0"]  # deepspeed_c's own core binding instead of Intel MPI's
        genv += ["-hosts", ",".join(active_resources.keys())]

        blocks: list[str] = []
        for rank in range(total):
            local_rank = rank % per_node
            prefix: list[str] = []
            if self.args.bind_cores_to_rank:
                _, prefix = get_numactl_cmd(self.args.bind_core_list, per_node, local_rank)
            block = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(local_rank)]
            block += prefix + _python_exec(self.args) + [self.user_script] + self.user_arguments
            blocks += ([":"] if blocks else []) + block
        return head + genv + blocks


class MPICHRunner(_HydraRunner):

    @property
    def name(self) -> str:
        return "mpich"


class IMPIRunner(_HydraRunner):

    @property
    def name(self) -> str:
        return "impi"


class SlurmRunner(MultiNodeRunner):
    """srun sized from the active resources; whole nodes only, the same slot count on each."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self) -> bool:
        return shutil.which("sinfo") is not None

    @property
    def name(self) -> str:
        return "slurm"

    def parse_user_args(self) -> list[str]:
        # srun re-splits JSON with spaces or comments badly: pass JSON arguments compact.
        out = []
        for arg in self.args.user_args:
            if arg.startswith("{") and arg.endswith("}"):
                try:
                    arg = json.dumps(json.loads(arg), separators=(",", ":"))
                except json.JSONDecodeError as err:
                    raise ValueError(f"SLURM needs plain JSON in script arguments (no comments, lowercase "
                                     f"true/false): {arg!r}") from err
            out.append(arg)
        return out

    @staticmethod
    def validate_active_resources(active_resources: Resources) -> None:
        active_resources = as_slot_lists(active_resources)
        for host, slots in active_resources.items():
            if list(slots) != list(range(len(slots))):
                raise ValueError(f"the slurm launcher cannot pin tasks to specific device ids (host {host!r} "
                                 f"slots {list(slots)}); include or exclude whole nodes, or use --num_gpus")
        counts = {host: len(slots) for host, slots in active_resources.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"the slurm launcher needs the same slot count on every node, got {counts}")

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        active_resources = as_slot_lists(active_resources)
        self.validate_active_resources(active_resources)
        total = sum(len(s) for s in active_resources.values())
        srun = ["srun", "-n", f"{total}"] + shlex.split(self.args.launcher_args)
        if getattr(self.args, "comment", ""):
            srun += ["--comment", self.args.comment]
        if getattr(self.args, "account", ""):
            srun += ["--account", self.args.account]
        if self.args.include != "" or self.args.exclude != "":
            # Without --nodes, srun may place -n tasks on a subset of the list.
            srun += ["--nodelist", ",".join(active_resources.keys()), "--nodes", f"{len(active_resources)}"]
        elif self.args.num_nodes > 0:
            srun += ["--nodes", f"{self.args.num_nodes}"]
        if self.args.num_gpus > 0:
            srun += ["--gpus-per-node", f"{self.args.num_gpus}"]
        exports = "--export=ALL" + "".join(f",{k}={v}" for k, v in
                                           list(self.exports.items()) + self._rendezvous_exports())
        return srun + [exports] + _python_exec(self.args) + [self.user_script] + self.user_arguments


def _has_nvidia_gpu() -> bool:
    from deepspeed_c.launcher.resources import count_local_gpus
    return count_local_gpus() > 0
