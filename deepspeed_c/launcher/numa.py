"""Core binding for `--bind_cores_to_rank` / `--bind_core_list`.

The cores (the `--bind_core_list` ranges, else one hardware thread per physical core this
process may run on) are split into equal consecutive blocks, one per local rank; a rank also
gets OMP_NUM_THREADS = its block size. With `numactl` installed the rank runs under
`numactl [-m NODE] -C CORES` (memory bound to the NUMA node when the block lies inside one);
without it the launcher sets the CPU affinity itself (no memory binding).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess


def parse_range(rng: str) -> range:
    """"3" -> [3]; "2-5" -> [2, 3, 4, 5]."""
    if rng.isdigit():
        value = int(rng)
        return range(value, value + 1)
    parts = rng.split("-")
    if len(parts) != 2 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"Bad range: {rng!r}, a range is a number or two numbers separated by a dash")
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"Bad range: {rng!r}, range end must be larger than or equal to start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """"0,2-4,6" -> [0, 2, 3, 4, 6]; sub-ranges ascend and do not overlap; no spaces."""
    numbers: list[int] = []
    last = -1
    for sub in range_str.split(","):
        block = parse_range(sub)
        if block[0] <= last:
            raise ValueError(f"Bad range: {range_str!r}, sub ranges must not overlap and must be in "
                             "ascending order")
        last = block[-1]
        numbers.extend(block)
    return numbers


def format_range_list(cores: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (numactl's -C syntax)."""
    if not cores:
        raise ValueError("an empty core list cannot be formatted")
    parts: list[str] = []
    start = prev = cores[0]
    for core in cores[1:] + [None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


def _physical_cores() -> list[int]:
    """CPUs this process may use, one hardware thread per core (the lowest sibling)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))
    keep = []
    for cpu in allowed:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as fd:
                siblings = parse_range_list(fd.read().strip())
        except (OSError, ValueError):
            siblings = [cpu]
        usable = [s for s in siblings if s in allowed]
        if not usable or min(usable) == cpu:
            keep.append(cpu)
    return keep


def numa_core_map() -> dict[int, list[int]]:
    """{numa node: [cpus]} from sysfs; {} when the topology is not readable."""
    base = "/sys/devices/system/node"
    result: dict[int, list[int]] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return result
    for name in names:
        match = re.fullmatch(r"node(\d+)", name)
        if not match:
            continue
        try:
            with open(os.path.join(base, name, "cpulist")) as fd:
                text = fd.read().strip()
            result[int(match.group(1))] = parse_range_list(text) if text else []
        except (OSError, ValueError):
            continue
    return dict(sorted(result.items()))


def cores_for_rank(bind_core_list: str | None, num_local_procs: int, local_rank: int) -> tuple[int, list[int]]:
    """(cores per rank, this rank's cores)."""
    if "KMP_AFFINITY" in os.environ:
        raise ValueError("Environment variable KMP_AFFINITY conflicts with core binding, because it changes "
                         "which cores each rank's threads use. Unset KMP_AFFINITY before launching "
                         "(`unset KMP_AFFINITY`), or launch without --bind_cores_to_rank.")
    cores = parse_range_list(bind_core_list) if bind_core_list is not None else _physical_cores()
    cores_per_rank = len(cores) // num_local_procs
    if cores_per_rank < 1:
        raise ValueError(f"--bind_cores_to_rank needs at least one core per rank: {len(cores)} cores for "
                         f"{num_local_procs} local ranks")
    return cores_per_rank, cores[cores_per_rank * local_rank:cores_per_rank * (local_rank + 1)]


def numactl_cmd(rank_cores: list[int], numa_map: dict[int, list[int]] | None = None) -> list[str]:
    """`numactl [-m NODE] -C CORES`; -m only when all the cores lie in one NUMA node."""
    numa_map = numa_core_map() if numa_map is None else numa_map
    cmd = ["numactl"]
    for node, node_cores in numa_map.items():
        if node_cores and set(rank_cores) <= set(node_cores):
            cmd += ["-m", str(node)]
            break
    return cmd + ["-C", format_range_list(rank_cores)]


def get_numactl_cmd(bind_core_list: str | None, num_local_procs: int, local_rank: int) -> tuple[int, list[str]]:
    """(cores per rank, numactl prefix) as DeepSpeed's helper returns them."""
    cores_per_rank, rank_cores = cores_for_rank(bind_core_list, num_local_procs, local_rank)
    return cores_per_rank, numactl_cmd(rank_cores)


def numactl_available() -> bool:
    return shutil.which("numactl") is not None


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd + ["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def working_numactl_prefix(rank_cores: list[int]) -> list[str] | None:
    """A numactl prefix that works here: with memory binding, else CPU binding only (containers
    without CAP_SYS_NICE refuse -m), else None (the caller sets the CPU affinity itself)."""
    if not numactl_available():
        return None
    full = numactl_cmd(rank_cores)
    if _runs(full):
        return full
    cpu_only = ["numactl", "-C", format_range_list(rank_cores)]
    return cpu_only if _runs(cpu_only) else None
