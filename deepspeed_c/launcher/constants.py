"""Names and defaults shared by the runner, the per-node launcher and the multi-node runners.

Launcher names and defaults follow DeepSpeed's `deepspeed.launcher.constants`.
"""
from __future__ import annotations

import os
import tempfile

PDSH_LAUNCHER = "pdsh"
PDSH_MAX_FAN_OUT = 1024

OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MVAPICH_TMP_HOSTFILE = os.path.join(tempfile.gettempdir(), "deepspeed_mvapich_hostfile")

SUPPORTED_LAUNCHERS = (PDSH_LAUNCHER, OPENMPI_LAUNCHER, MVAPICH_LAUNCHER, MPICH_LAUNCHER, IMPI_LAUNCHER,
                       SLURM_LAUNCHER)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
DLTS_HOSTFILE = "/job/hostfile"

# Per-rank environment (DeepSpeed's deepspeed.constants CROSS_RANK / CROSS_SIZE).
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"

# Variables whose name starts with one of these are forwarded to remote nodes.
EXPORT_ENVS = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW")
# On AISC compute each node sets these itself; forwarding rank 0's values would be wrong.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}

DEEPSPEED_ENVIRONMENT_PATHS = (os.path.expanduser("~"), ".")

PID_FILE_BASEPATH = "/tmp"

# Fault handling: how often the launcher looks at its ranks, and how long a rank gets between
# SIGTERM/SIGINT and SIGKILL. Detection + grace + reaping stay well inside 5 seconds.
POLL_INTERVAL_S = 0.1
TERMINATE_GRACE_S = 2.0
