"""Hostfile, --include/--exclude, --num_nodes/--num_gpus, world info, .deepspeed_env and core lists."""
from __future__ import annotations

import os

import pytest

from deepspeed_c.launcher import runner as dsrun
from deepspeed_c.launcher.environment import forwarded_variables, load_deepspeed_env, parse_deepspeed_env
from deepspeed_c.launcher.numa import (cores_for_rank, format_range_list, numactl_cmd, parse_range_list)
from deepspeed_c.launcher.resources import decode_world_info

TWO_NODES = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


# --- hostfile -----------------------------------------------------------------------------------

def test_hostfile_good_lines_comments_and_blanks():
    text = """
    worker-1 slots=2
    worker-2 slots=2

    localhost slots=1
    123.23.12.10 slots=2   # trailing comment
    #worker-1 slots=3
    # a comment
    """
    pool = dsrun._parse_hostfile(text.splitlines())
    assert list(pool.items()) == [("worker-1", 2), ("worker-2", 2), ("localhost", 1), ("123.23.12.10", 2)]


@pytest.mark.parametrize("text, message", [
    ("worker-1 slots=2\nworker-2 slots=1\nworker-1 slots=1\n", "multiple entries for worker-1"),
    ("this is bad slots=1\n", "bad entry"),
    ("missingslots\n", "bad entry"),
    ("worker-1 slots=two\n", "bad entry"),
    ("   \n\n# only a comment\n", "empty"),
    ("worker-1 slots=2\nthis is bad slots=1\nworker-2 slots=4\n", "bad entry"),
])
def test_hostfile_bad(text, message):
    with pytest.raises(ValueError, match=message):
        dsrun._parse_hostfile(text.splitlines())


def test_fetch_hostfile_reads_file_and_missing_file_is_none(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=4\nb slots=8\n")
    assert dict(dsrun.fetch_hostfile(str(path))) == {"a": 4, "b": 8}
    assert dsrun.fetch_hostfile(str(tmp_path / "absent")) is None


# --- include / exclude --------------------------------------------------------------------------

@pytest.mark.parametrize("hosts, include, exclude, expected", [
    ({"worker-0": [0, 1, 2, 3]}, "", "", {"worker-0": [0, 1, 2, 3]}),
    ({"worker-0": [0, 1, 2, 3]}, "", "worker-0:1", {"worker-0": [0, 2, 3]}),
    ({"worker-0": [0, 1, 2, 3]}, "", "worker-0:1,2", {"worker-0": [0, 3]}),
    ({"worker-0": [0, 1, 2, 3]}, "worker-0:1", "", {"worker-0": [1]}),
    ({"worker-0": [0, 1, 2, 3]}, "worker-0:1,1", "", {"worker-0": [1]}),
    ({"worker-0": [0, 1, 2, 3]}, "worker-0:1@worker-0:0,1", "", {"worker-0": [0, 1]}),
    ({"worker-0": [0, 1, 2, 3]}, "worker-0", "", {"worker-0": [0, 1, 2, 3]}),
    ({"worker-0": [0, 1, 2, 3]}, "", "worker-0", {}),
    ({"worker-0": [0, 1, 2, 3]}, "", "worker-0:0,1,2,3", {}),
    (TWO_NODES, "worker-1:0,3", "", {"worker-1": [0, 3]}),
    (TWO_NODES, "", "worker-1", {"worker-0": [0, 1, 2, 3]}),
    (TWO_NODES, "", "worker-0:0,1@worker-1:3", {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
    # host order is the pool's, not the filter's
    (TWO_NODES, "worker-1:2@worker-0:1", "", {"worker-0": [1], "worker-1": [2]}),
])
def test_resource_filter_table(hosts, include, exclude, expected):
    result = dsrun.parse_resource_filter(hosts, include_str=include, exclude_str=exclude)
    assert dict(result) == expected
    assert list(result) == list(expected)


@pytest.mark.parametrize("include, exclude, message", [
    ("A", "B", "mutually exclusive"),
    ("jeff", "", "not found in hostfile"),
    ("", "jeff", "not found in hostfile"),
    ("worker-1:4", "", "No slot '4'"),
    ("", "worker-1:4", "No slot '4'"),
    ("", "worker-1@worker-0:1@5", "'5' not found"),
    ("worker-0:a", "", "bad slot list"),
    ("worker-0@", "", "empty node"),
])
def test_resource_filter_errors(include, exclude, message):
    with pytest.raises(ValueError, match=message):
        dsrun.parse_resource_filter(TWO_NODES, include_str=include, exclude_str=exclude)


@pytest.mark.parametrize("include, exclude, expected", [
    ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ("worker-0", "", {"worker-0": [0, 1, 2, 3]}),
    ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
    ("", "worker-0:1", {"worker-0": [0, 2, 3], "worker-1": [0, 1, 2, 3]}),
])
def test_inclusion_exclusion_from_slot_counts(include, exclude, expected):
    assert dict(dsrun.parse_inclusion_exclusion({"worker-0": 4, "worker-1": 4}, include, exclude)) == expected


@pytest.mark.parametrize("spec", ["worker-0:4", "worker-0:99", "worker-0:0,4"])
def test_inclusion_exclusion_rejects_out_of_range_slots(spec):
    with pytest.raises(ValueError):
        dsrun.parse_inclusion_exclusion({"worker-0": 4}, spec, "")
    with pytest.raises(ValueError):
        dsrun.parse_inclusion_exclusion({"worker-0": 4}, "", spec)


@pytest.mark.parametrize("num_nodes, num_gpus, expected", [
    (-1, -1, {"a": [0, 1, 2], "b": [1, 2], "c": [0]}),
    (2, -1, {"a": [0, 1, 2], "b": [1, 2]}),
    (-1, 2, {"a": [0, 1], "b": [0, 1], "c": [0, 1]}),
    (1, 4, {"a": [0, 1, 2, 3]}),
])
def test_num_nodes_and_gpus(num_nodes, num_gpus, expected):
    active = {"a": [0, 1, 2], "b": [1, 2], "c": [0]}
    assert dict(dsrun.apply_num_nodes_and_gpus(active, num_nodes, num_gpus)) == expected


@pytest.mark.parametrize("argv", [
    "--num_nodes 1 -i localhost foo.py", "--num_nodes 1 --num_gpus 1 -i localhost foo.py",
    "--num_gpus 1 -i localhost foo.py", "--num_nodes 1 -e localhost foo.py",
    "--num_nodes 1 --num_gpus 1 -e localhost foo.py", "--num_gpus 1 -e localhost foo.py",
])
def test_num_flags_exclude_include_flags(argv):
    with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
        dsrun.main(args=argv.split())


def test_world_info_round_trip_keeps_host_order():
    info = {"zeta": [0, 2], "alpha": [1], "mid": [0, 1, 2, 3]}
    decoded = decode_world_info(dsrun.encode_world_info(info))
    assert list(decoded.items()) == list(info.items())
    with pytest.raises(ValueError, match="world_info"):
        decode_world_info("not-base64!")


def test_runner_flags_and_defaults_match_deepspeed():
    args = dsrun.parse_args(["train.py", "--lr", "3"])
    assert (args.hostfile, args.include, args.exclude, args.num_nodes, args.num_gpus) == (
        "/job/hostfile", "", "", -1, -1)
    assert (args.master_port, args.master_addr, args.node_rank, args.launcher, args.launcher_args) == (
        29500, "", -1, "pdsh", "")
    assert args.enable_each_rank_log == "None" and args.bind_core_list is None and args.ssh_port is None
    assert (args.user_script, args.user_args) == ("train.py", ["--lr", "3"])
    assert dsrun.parse_args(["--num_accelerators", "3", "x.py"]).num_gpus == 3
    assert dsrun.DEEPSPEED_ENVIRONMENT_NAME == os.getenv("DS_ENV_FILE", ".deepspeed_env")


@pytest.mark.parametrize("argv, error", [
    ("--launcher nosuch foo.py", ValueError),
    ("--elastic_training --master_addr 1.2.3.4 foo.py", NotImplementedError),
    ("--autotuning tune foo.py", ValueError),  # foo.py is given no --deepspeed_config to tune from
    ("--hostfile /nonexistent/hostfile foo.py", FileNotFoundError),
])
def test_runner_rejects_unbuilt_or_bad_flags(argv, error):
    with pytest.raises(error):
        dsrun.main(args=argv.split())


# --- .deepspeed_env -----------------------------------------------------------------------------

def test_deepspeed_env_parse_and_merge(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nA=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nA=cwd\nexport NCCL_SOCKET_IFNAME=eth0\nB=x=y z\n")
    merged = load_deepspeed_env([str(home), str(cwd)], ".deepspeed_env")
    assert dict(merged) == {"NCCL_IB_DISABLE": "1", "A": "cwd", "NCCL_SOCKET_IFNAME": "eth0", "B": "x=y z"}
    with pytest.raises(ValueError, match=r":2: expected NAME=VALUE"):
        parse_deepspeed_env(["OK=1", "no equals sign"])


def test_forwarded_variables_prefixes_and_aisc_exclusion():
    env = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "MV2_X": "1", "UCX_TLS": "tcp", "MLFLOW_URI": "u",
           "HOME": "/root", "NCCL_IB_HCA": "mlx5"}
    assert set(forwarded_variables(env)) == {"NCCL_DEBUG", "PYTHONPATH", "MV2_X", "UCX_TLS", "MLFLOW_URI",
                                             "NCCL_IB_HCA"}
    assert "NCCL_IB_HCA" not in forwarded_variables(dict(env, AISC_JOB_NAME="job"))


# --- core binding -------------------------------------------------------------------------------

def test_range_lists():
    assert parse_range_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert format_range_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("3-1", "1,1", "0-2,1", "a", "1-2-3"):
        with pytest.raises(ValueError):
            parse_range_list(bad)


def test_cores_split_per_rank(monkeypatch):
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    blocks = [cores_for_rank("0-7", 4, r) for r in range(4)]
    assert blocks == [(2, [0, 1]), (2, [2, 3]), (2, [4, 5]), (2, [6, 7])]
    assert numactl_cmd([4, 5], {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}) == ["numactl", "-m", "1", "-C", "4-5"]
    assert numactl_cmd([3, 4], {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}) == ["numactl", "-C", "3-4"]
    with pytest.raises(ValueError, match="at least one core"):
        cores_for_rank("0-2", 4, 0)
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(ValueError, match="KMP_AFFINITY"):
        cores_for_rank("0-7", 4, 0)


@pytest.mark.parametrize("env, expected", [({"DS_ACCELERATOR": "cpu"}, 0), ({"CUDA_VISIBLE_DEVICES": ""}, 0),
                                           ({"CUDA_VISIBLE_DEVICES": "-1"}, 0)])
def test_gpus_hidden_means_cpu_processes(monkeypatch, env, expected):
    from deepspeed_c.launcher.resources import count_local_gpus
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert count_local_gpus() == expected


def test_visible_device_ids():
    from deepspeed_c.launcher.resources import visible_device_ids
    assert visible_device_ids("0,2, 3") == [0, 2, 3]
    with pytest.raises(ValueError, match="--include"):
        visible_device_ids("GPU-1234abcd")
