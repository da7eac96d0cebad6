"""The multi-node runners driven the way DeepSpeed's own tests drive them: constructed with
`(args, world_info_base64, resource_pool)` where resource_pool is DeepSpeed's host -> slot count
dict, and `get_cmd(environment, active_resources)` given that same dict (DeepSpeed's runners read
only the hosts and counts from it). pdsh returns (cmd, kill_cmd, env); the others return argv."""
from __future__ import annotations

import os
from copy import deepcopy

import pytest

from deepspeed_c.launcher import multinode_runner as mnrunner
from deepspeed_c.launcher.runner import encode_world_info, parse_args


@pytest.fixture
def runner_info():
    hosts = {"worker-0": 4, "worker-1": 4}
    return deepcopy(dict(os.environ)), hosts, encode_world_info(hosts), parse_args(["test_launcher.py"])


def test_pdsh_runner(runner_info):
    env, pool, world_info, args = runner_info
    cmd, kill_cmd, env = mnrunner.PDSHRunner(args, world_info).get_cmd(env, pool)
    assert cmd[0] == "pdsh" and "worker-0,worker-1" in " ".join(cmd)
    assert kill_cmd[0] == "pdsh"


@pytest.mark.parametrize("cls,program", [("OpenMPIRunner", "mpirun"), ("MPICHRunner", "mpirun"),
                                         ("IMPIRunner", "mpirun"), ("SlurmRunner", "srun"),
                                         ("MVAPICHRunner", "mpirun")])
def test_mpi_and_slurm_runners(runner_info, cls, program):
    env, pool, world_info, args = runner_info
    runner = getattr(mnrunner, cls)(args, world_info, pool)
    cmd = runner.get_cmd(env, pool)
    assert cmd[0] == program
    assert "8" in cmd  # 2 hosts x 4 slots
    assert cmd[-1] == "test_launcher.py" or "test_launcher.py" in cmd
