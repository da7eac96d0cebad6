"""Multi-node command lines (no ssh, no MPI: only the argv each runner builds), and the runner's
multi-node path end to end with a stand-in `pdsh` executable that records its arguments."""
from __future__ import annotations

import json
import os
import shlex
import stat
import sys

import pytest

from deepspeed_c.launcher import multinode_runner as mnrunner
from deepspeed_c.launcher import runner as dsrun
from deepspeed_c.launcher.resources import decode_world_info

POOL = {"worker-0": 2, "worker-1": 2}
ACTIVE = {"worker-0": [0, 1], "worker-1": [0, 1]}
PY = sys.executable


def _args(*argv: str):
    return dsrun.parse_args(["--hostfile", "/hf", "--master_addr", "10.0.0.1", "--master_port", "29999", *argv,
                             "train.py", "--cfg", "a b"])


@pytest.fixture
def world_info() -> str:
    return dsrun.encode_world_info(ACTIVE)


def test_pdsh_command_and_kill_command(world_info):
    runner = mnrunner.PDSHRunner(_args("--launcher_args", "-R ssh", "--no_local_rank", "--bind_cores_to_rank"),
                                 world_info, launch_id="job7")
    runner.add_export("NCCL_DEBUG", "INFO")
    runner.add_export("QUOTED", 'say "hi" to $USER')
    cmd, kill_cmd, env = runner.get_cmd({}, ACTIVE)
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    head = ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh"]
    assert cmd == head + [
        'export NCCL_DEBUG="INFO"; export QUOTED="say \\"hi\\" to $USER"; ', f"cd {shlex.quote(os.getcwd())};",
        shlex.quote(PY), "-u", "-m", "deepspeed_c.launcher.launch", f"--world_info={world_info}", "--node_rank=%n",
        "--master_addr=10.0.0.1", "--master_port=29999", "--launch_id=job7", "--no_local_rank", "--bind_cores_to_rank",
        "train.py", "--cfg", "'a b'"
    ]
    # The remote shell sees one command line: it must split back into the user's arguments.
    assert shlex.split(" ".join(cmd[-3:])) == ["train.py", "--cfg", "a b"]
    assert kill_cmd == head + ["test -f /tmp/deepspeed_c_launch_job7.pid && "
                               "kill -TERM $(cat /tmp/deepspeed_c_launch_job7.pid)"]


def test_pdsh_ssh_port(world_info):
    _, _, env = mnrunner.PDSHRunner(_args("--ssh_port", "2200"), world_info).get_cmd({}, ACTIVE)
    assert env["PDSH_SSH_ARGS_APPEND"] == "-p 2200"


def test_openmpi_command(world_info):
    runner = mnrunner.OpenMPIRunner(_args(), world_info, POOL)
    runner.add_export("NCCL_DEBUG", "INFO")
    assert runner.get_cmd({}, ACTIVE) == [
        "mpirun", "-n", "4", "-hostfile", "/hf", "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0",
        "-x", "UCX_TLS=tcp", "-x", "NCCL_DEBUG=INFO", "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29999",
        PY, "-u", "train.py", "--cfg", "a b"
    ]


@pytest.mark.parametrize("launcher_args", ["-mca btl_tcp_if_include eth1", "--mca btl_tcp_if_include eth1"])
def test_openmpi_user_nic_replaces_eth0(world_info, launcher_args):
    cmd = mnrunner.OpenMPIRunner(_args("--launcher_args", launcher_args), world_info, POOL).get_cmd({}, ACTIVE)
    assert "eth0" not in cmd and "eth1" in cmd


def test_mvapich_command_and_hostfile(world_info, tmp_path):
    runner = mnrunner.MVAPICHRunner(_args("--module"), world_info, POOL, cuda=True)
    runner.hostfile_path = str(tmp_path / "mv_hosts")
    cmd = runner.get_cmd({}, ACTIVE)
    mv2 = ["MV2_SMP_USE_CMA=0", "MV2_DEBUG_SHOW_BACKTRACE=1", "MV2_USE_CUDA=1", "MV2_SUPPORT_DL=1",
           "MV2_ENABLE_AFFINITY=0", "MV2_INTER_ALLGATHER_TUNING=5", "MV2_CUDA_USE_NAIVE=0", "MASTER_ADDR=10.0.0.1",
           "MASTER_PORT=29999"]
    expected_env = [x for kv in mv2 for x in ("-env", kv)]
    assert cmd == ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", runner.hostfile_path] + expected_env + [
        PY, "-u", "-m", "train.py", "--cfg", "a b"]
    assert (tmp_path / "mv_hosts").read_text() == "worker-0\nworker-1\n"


@pytest.mark.parametrize("cls, extra", [(mnrunner.MPICHRunner, []), (mnrunner.IMPIRunner, ["-genv", "I_MPI_PIN", "0"])])
def test_hydra_commands_one_block_per_rank(world_info, cls, extra):
    runner = cls(_args(), world_info, POOL)
    runner.add_export("FOO", "bar")
    cmd = runner.get_cmd({}, ACTIVE)
    genv = ["-genv", "FOO", "bar", "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29999", "-genv",
            "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2"] + extra + ["-hosts", "worker-0,worker-1"]
    blocks = []
    for rank, local in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        blocks += ([":"] if blocks else []) + ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(local),
                                                PY, "-u", "train.py", "--cfg", "a b"]
    assert cmd == ["mpirun", "-ppn", "2"] + genv + blocks


def test_impi_core_binding_without_local_numactl(world_info, monkeypatch):
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    monkeypatch.setattr(mnrunner.shutil, "which", lambda name: None)
    cmd = mnrunner.IMPIRunner(_args("--bind_cores_to_rank", "--bind_core_list", "0-7"), world_info,
                              {"worker-0": 4, "worker-1": 4}).get_cmd({}, {"worker-0": [0, 1, 2, 3],
                                                                           "worker-1": [0, 1, 2, 3]})
    assert cmd[cmd.index("OMP_NUM_THREADS") + 1] == "2"
    assert cmd.count("numactl") == 8 and cmd.index("numactl") > cmd.index("-hosts")
    assert [cmd[i + 1] for i, tok in enumerate(cmd) if tok == "-C"] == ["0-1", "2-3", "4-5", "6-7"] * 2


def test_hydra_needs_equal_slots(world_info):
    with pytest.raises(ValueError, match="same number of devices per node"):
        mnrunner.MPICHRunner(_args(), world_info, POOL).get_cmd({}, {"worker-0": [0, 1], "worker-1": [0]})


@pytest.mark.parametrize("cls", [mnrunner.OpenMPIRunner, mnrunner.MVAPICHRunner, mnrunner.MPICHRunner,
                                 mnrunner.IMPIRunner])
@pytest.mark.parametrize("flags, message", [(["--include", "worker-0"], "include/exclusion"),
                                            (["--num_gpus", "1"], "limiting num nodes/gpus")])
def test_mpi_runners_reject_resource_filters(world_info, cls, flags, message):
    with pytest.raises(ValueError, match=message):
        cls(_args(*flags), world_info, POOL)


def test_slurm_command(world_info):
    runner = mnrunner.SlurmRunner(_args("--comment", "c1", "--account", "acct"), world_info, POOL)
    runner.add_export("NCCL_DEBUG", "INFO")
    assert runner.get_cmd({}, ACTIVE) == [
        "srun", "-n", "4", "--comment", "c1", "--account", "acct",
        "--export=ALL,NCCL_DEBUG=INFO,MASTER_ADDR=10.0.0.1,MASTER_PORT=29999", PY, "-u", "train.py", "--cfg", "a b"
    ]


@pytest.mark.parametrize("flags, nodelist, nodes, tasks", [
    (["--exclude", "worker-1"], "worker-0", "1", "2"),
    (["--include", "worker-0:0,1@worker-1:0,1"], "worker-0,worker-1", "2", "4"),
])
def test_slurm_resource_filters(world_info, flags, nodelist, nodes, tasks):
    args = _args(*flags)
    active = dsrun.parse_inclusion_exclusion(POOL, args.include, args.exclude)
    cmd = mnrunner.SlurmRunner(args, world_info, POOL).get_cmd({}, active)
    assert (cmd[cmd.index("--nodelist") + 1], cmd[cmd.index("--nodes") + 1], cmd[cmd.index("-n") + 1]) == (
        nodelist, nodes, tasks)


@pytest.mark.parametrize("flags, flag, value, tasks", [(["--num_gpus", "1"], "--gpus-per-node", "1", "2"),
                                                       (["--num_nodes", "1"], "--nodes", "1", "2")])
def test_slurm_num_nodes_and_gpus(world_info, flags, flag, value, tasks):
    args = _args(*flags)
    active = dsrun.apply_num_nodes_and_gpus(dsrun.parse_inclusion_exclusion(POOL, "", ""), args.num_nodes,
                                            args.num_gpus)
    cmd = mnrunner.SlurmRunner(args, world_info, POOL).get_cmd({}, active)
    assert "--nodelist" not in cmd and cmd.count(flag) == 1
    assert (cmd[cmd.index(flag) + 1], cmd[cmd.index("-n") + 1]) == (value, tasks)


@pytest.mark.parametrize("flags, message", [(["--include", "worker-1:1"], "specific device ids"),
                                            (["--exclude", "worker-1:0"], "specific device ids"),
                                            (["--exclude", "worker-1:1"], "same slot count")])
def test_slurm_rejects_filters_it_cannot_express(world_info, flags, message):
    args = _args(*flags)
    active = dsrun.parse_inclusion_exclusion(POOL, args.include, args.exclude)
    with pytest.raises(ValueError, match=message):
        mnrunner.SlurmRunner(args, world_info, POOL).get_cmd({}, active)


def test_slurm_compacts_json_arguments(world_info):
    args = dsrun.parse_args(["--launcher", "slurm", "train.py", '{"a": 1, "b": [true]}'])
    assert mnrunner.SlurmRunner(args, world_info, POOL).user_arguments == ['{"a":1,"b":[true]}']
    bad = dsrun.parse_args(["train.py", "{'a': True}"])
    with pytest.raises(ValueError, match="plain JSON"):
        mnrunner.SlurmRunner(bad, world_info, POOL)


FAKE_PDSH = """#!{python}
import json, os, sys
with open(os.environ["PDSH_RECORD"], "a") as fd:
    fd.write(json.dumps({{"argv": sys.argv[1:], "rcmd": os.environ.get("PDSH_RCMD_TYPE"),
                         "pythonpath": os.environ.get("PYTHONPATH")}}) + "\\n")
sys.exit(7)
"""


def test_runner_multinode_path_with_recording_pdsh(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "pdsh"
    fake.write_text(FAKE_PDSH.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record.jsonl"
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\nnode-c slots=2\n")
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth9\nMY_FLAG=on\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PDSH_RECORD", str(record))
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)

    with pytest.raises(SystemExit) as exit_info:
        dsrun.main(["--hostfile", "hosts", "--exclude", "node-b", "--master_addr", "10.1.1.1", "--no_ssh_check",
                    "train.py", "--x", "1"])
    assert exit_info.value.code == 7  # the launch command's exit status comes back
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    argv = call["argv"]
    assert argv[:6] == ["-S", "-f", "1024", "-w", "node-a,node-c"] + [argv[5]]
    exports = argv[5]
    for expected in ['export NCCL_DEBUG="WARN";', 'export NCCL_SOCKET_IFNAME="eth9";', 'export MY_FLAG="on";',
                     f'export PYTHONPATH="{tmp_path}";']:
        assert expected in exports
    assert call["rcmd"] == "ssh" and call["pythonpath"] == str(tmp_path)
    world = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    assert dict(decode_world_info(world)) == {"node-a": [0, 1], "node-c": [0, 1]}
    assert argv[-3:] == ["train.py", "--x", "1"]


def test_runner_no_ssh_requires_valid_node_rank(tmp_path, monkeypatch):
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--node_rank"):
        dsrun.main(["--hostfile", "hosts", "--no_ssh", "--node_rank", "2", "--master_addr", "1.2.3.4", "t.py"])
    with pytest.raises(ValueError, match="--master_addr"):
        dsrun.main(["--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "t.py"])
