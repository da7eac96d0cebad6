"""The launcher end to end on CPU: real processes started by `python -m deepspeed_c.launcher.runner`.

Each launched script reports what it saw (environment, arguments, a gloo all_reduce) into files
that the test reads back; fault tests check exit codes, timing and that no process is left.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import free_port

REPO = Path(__file__).resolve().parents[2]

# Checks its environment against its --local_rank argument and does a gloo all_reduce.
ALLREDUCE_SCRIPT = textwrap.dedent("""
    import argparse, json, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)
    parser.add_argument("--tag", type=str, required=True)
    args = parser.parse_args()
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ["OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
            "CROSS_SIZE", "FROM_ENV_FILE", "CUDA_VISIBLE_DEVICES"]
    report = {"env": {k: os.environ.get(k) for k in keys}, "affinity": sorted(os.sched_getaffinity(0)), "local_rank_arg": args.local_rank, "tag": args.tag,
              "dist_rank": rank, "dist_world": world, "sum": t.item(), "pid": os.getpid(), "argv": sys.argv[1:]}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as fd:
        json.dump(report, fd)
""")

# Every rank starts a grandchild and reports ready; rank FAIL_RANK then exits with FAIL_CODE (or
# kills itself with FAIL_SIGNAL). Rank 0 ignores SIGTERM, so only SIGKILL stops it.
FAULT_SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, rank, world = os.environ["OUT_DIR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(out, f"pids{rank}"), "w") as fd:
        fd.write(f"{os.getpid()} {child.pid}")
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out, f"ready{rank}"), "w").close()
    if rank == int(os.environ["FAIL_RANK"]):
        while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(world)):
            time.sleep(0.05)
        with open(os.path.join(out, "failed_at"), "w") as fd:
            fd.write(repr(time.time()))
        if os.environ.get("FAIL_SIGNAL"):
            os.kill(os.getpid(), int(os.environ["FAIL_SIGNAL"]))
        sys.exit(int(os.environ["FAIL_CODE"]))
    time.sleep(120)
""")

# Records which signal reached it, then exits; its grandchild must be stopped by the launcher.
SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, rank = os.environ["OUT_DIR"], int(os.environ["RANK"])
    def on_signal(signum, frame):
        with open(os.path.join(out, f"got{rank}"), "w") as fd:
            fd.write(signal.Signals(signum).name)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(out, f"pids{rank}"), "w") as fd:
        fd.write(f"{os.getpid()} {child.pid}")
    open(os.path.join(out, f"ready{rank}"), "w").close()
    time.sleep(120)
""")

ECHO_SCRIPT = textwrap.dedent("""
    import json, os, sys
    rank = os.environ["RANK"]
    print(f"hello from rank {rank}", flush=True)
    with open(os.path.join(os.environ["OUT_DIR"], f"argv{rank}.json"), "w") as fd:
        json.dump({"argv": sys.argv[1:], "name": __name__}, fd)
""")


def _has_gpu() -> bool:
    import torch
    return torch.cuda.device_count() > 0


def _env(out_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OUT_DIR=str(out_dir), HOME=str(out_dir), **extra)
    return env


def _runner_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deepspeed_c.launcher.runner", "--master_port", str(free_port()), *args]


def _start(cwd: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(_runner_cmd(*args), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait_files(directory: Path, names: list[str], proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((directory / n).exists() for n in names):
            return
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early ({proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {names}")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _recorded_pids(out: Path, world: int) -> list[int]:
    pids = []
    for r in range(world):
        pids += [int(p) for p in (out / f"pids{r}").read_text().split()]
    return pids


def _assert_all_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    assert [p for p in pids if not _gone(p)] == [], "processes outlived the launcher"


@pytest.fixture
def reap():
    """Kill (by pid) any launcher tree a failing test leaves behind."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            victims = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
            for v in victims:
                try:
                    v.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait(timeout=10)


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_launch_env_and_gloo_allreduce(tmp_path, world):
    (tmp_path / "train.py").write_text(ALLREDUCE_SCRIPT)
    (tmp_path / ".deepspeed_env").write_text("FROM_ENV_FILE=value with spaces\n")
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed_c.launcher.runner", "--num_gpus", str(world), "--master_port", str(port),
           "train.py", "--tag", "x y"]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, rep in enumerate(reports):
        env = rep["env"]
        assert rep["dist_rank"] == r and rep["dist_world"] == world
        assert env["RANK"] == str(r) and env["LOCAL_RANK"] == str(r) and rep["local_rank_arg"] == r
        assert env["WORLD_SIZE"] == str(world) and env["LOCAL_SIZE"] == str(world)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("0", "1")
        assert env["FROM_ENV_FILE"] == "value with spaces"
        # GPUs: every local rank sees the node's slot list; no GPU: CPU processes, variable untouched
        assert env["CUDA_VISIBLE_DEVICES"] == (",".join(map(str, range(world))) if _has_gpu() else None)
        assert rep["argv"] == [f"--local_rank={r}", "--tag", "x y"] and rep["tag"] == "x y"
        assert rep["sum"] == world * (world + 1) / 2
    _assert_all_gone([rep["pid"] for rep in reports])


def test_hostfile_include_selects_slots(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO_SCRIPT)
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    done = subprocess.run(_runner_cmd("--hostfile", "hosts", "--include", "localhost:1,3", "echo.py", "a"),
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.glob("argv*.json")) == ["argv0.json", "argv1.json"]
    assert json.loads((tmp_path / "argv1.json").read_text())["argv"] == ["--local_rank=1", "a"]


def test_no_local_rank_module_and_each_rank_log(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(ECHO_SCRIPT)
    done = subprocess.run(_runner_cmd("--num_gpus", "2", "--no_local_rank", "--module", "--enable_each_rank_log",
                                      "logs", "mypkg.train", "--flag"),
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for r in range(2):
        rep = json.loads((tmp_path / f"argv{r}.json").read_text())
        assert rep == {"argv": ["--flag"], "name": "__main__"}
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name.split("_")[-1] for p in logs] == ["rank0.log", "rank1.log"]
    assert [p.read_text().strip() for p in logs] == ["hello from rank 0", "hello from rank 1"]
    assert "hello from rank" not in done.stdout


def test_save_pid_file_names_the_launcher(tmp_path, reap):
    (tmp_path / "sig.py").write_text(SIGNAL_SCRIPT)
    proc = _start(tmp_path, _env(tmp_path), "--num_gpus", "1", "--save_pid", "sig.py")
    reap.append(proc)
    _wait_files(tmp_path, ["ready0"], proc)
    pid_file = Path(f"/tmp/{proc.pid}.deepspeed")
    launcher_pid = int(pid_file.read_text())
    assert psutil.Process(launcher_pid).ppid() == proc.pid
    assert "deepspeed_c.launcher.launch" in " ".join(psutil.Process(launcher_pid).cmdline())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not pid_file.exists()


@pytest.mark.parametrize("fail_signal, expected", [(None, 3), (signal.SIGKILL, 128 + signal.SIGKILL)])
def test_failing_rank_stops_the_others(tmp_path, reap, fail_signal, expected):
    world = 3
    (tmp_path / "fault.py").write_text(FAULT_SCRIPT)
    extra = {"FAIL_RANK": "1", "FAIL_CODE": "3"}
    if fail_signal is not None:
        extra["FAIL_SIGNAL"] = str(int(fail_signal))
    proc = _start(tmp_path, _env(tmp_path, **extra), "--num_gpus", str(world), "fault.py")
    reap.append(proc)
    _wait_files(tmp_path, [f"ready{r}" for r in range(world)], proc)
    pids = _recorded_pids(tmp_path, world)
    proc.wait(timeout=60)
    exited_at = time.time()
    output = proc.stdout.read()
    assert proc.returncode == expected, output
    failed_at = float((tmp_path / "failed_at").read_text())
    assert exited_at - failed_at < 5.0, f"launcher took {exited_at - failed_at:.2f}s to exit"
    _assert_all_gone(pids, timeout=0.5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_reaches_every_rank(tmp_path, reap, sig):
    world = 2
    (tmp_path / "sig.py").write_text(SIGNAL_SCRIPT)
    proc = _start(tmp_path, _env(tmp_path), "--num_gpus", str(world), "sig.py")
    reap.append(proc)
    _wait_files(tmp_path, [f"ready{r}" for r in range(world)], proc)
    pids = _recorded_pids(tmp_path, world)
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert set(pids) <= set(tree)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode == 128 + sig, proc.stdout.read()
    assert [(tmp_path / f"got{r}").read_text() for r in range(world)] == [sig.name] * world
    _assert_all_gone(tree, timeout=1.0)


def test_killed_launcher_leaves_no_rank(tmp_path, reap):
    """Even SIGKILL of the whole launcher chain leaves no rank running (parent-death signals)."""
    world = 2
    (tmp_path / "sig.py").write_text(SIGNAL_SCRIPT)
    proc = _start(tmp_path, _env(tmp_path), "--num_gpus", str(world), "sig.py")
    reap.append(proc)
    _wait_files(tmp_path, [f"ready{r}" for r in range(world)], proc)
    pids = _recorded_pids(tmp_path, world)
    proc.kill()
    proc.wait(timeout=10)
    # runner SIGKILLed -> launcher gets SIGTERM -> ranks and their children get SIGTERM from it
    _assert_all_gone(pids, timeout=5.0)
    assert [(tmp_path / f"got{r}").read_text() for r in range(world)] == ["SIGTERM"] * world


def test_bind_cores_to_rank(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 usable CPUs to give each of 2 ranks its own core")
    (tmp_path / "train.py").write_text(ALLREDUCE_SCRIPT)
    core_list = f"{cpus[0]},{cpus[1]}"
    done = subprocess.run(_runner_cmd("--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", core_list,
                                      "train.py", "--tag", "t"),
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [rep["affinity"] for rep in reports] == [[cpus[0]], [cpus[1]]]
    assert [rep["env"]["OMP_NUM_THREADS"] for rep in reports] == ["1", "1"]
