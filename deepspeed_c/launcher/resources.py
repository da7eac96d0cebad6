"""The resource pool: which hosts and which slots (GPUs, or CPU processes) a job runs on.

A hostfile lists `host slots=N` lines; `--include`/`--exclude` take `NODE[:SLOT[,SLOT...]][@NODE...]`;
`--num_nodes`/`--num_gpus` trim the result. The pool reaches every node as base64 JSON
(`--world_info`), an ordered `{host: [slot, ...]}`.

Local discovery never initialises CUDA: it counts GPUs from the driver's /proc entries or
`nvidia-smi -L`. A node without GPUs offers one slot per NUMA node (as DeepSpeed's CPU
accelerator does); `--num_gpus N` asks for N processes whatever the count.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from collections import OrderedDict
from typing import Iterable, Mapping

from deepspeed_c.utils.logging import logger

_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*(#.*)?$")


def fetch_hostfile(hostfile_path: str) -> "OrderedDict[str, int] | None":
    """Read a hostfile; None (with a warning) when it does not exist."""
    if not os.path.isfile(hostfile_path):
        logger.warning(f"Unable to find hostfile {hostfile_path!r}, will proceed with training with local "
                       "resources only.")
        return None
    with open(hostfile_path, "r") as fd:
        return _parse_hostfile(fd.readlines())


def _parse_hostfile(hostfile_lines: Iterable[str]) -> "OrderedDict[str, int]":
    """`host slots=N` lines, `#` comments and blank lines; duplicates, bad lines or no host raise."""
    lines = list(hostfile_lines)
    pool: "OrderedDict[str, int]" = OrderedDict()
    for raw in lines:
        line = raw.strip()
        if line == "" or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise ValueError(f"Hostfile contains a bad entry: {line!r}; expected 'hostname slots=N', "
                             "unable to proceed with launching")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise ValueError(f"Hostfile contains multiple entries for {host}, unable to proceed with launching")
        pool[host] = slots
    if not pool:
        raise ValueError("Hostfile is empty or not formatted correctly, unable to proceed with launching.")
    return pool


def parse_node_config(node_config: str) -> tuple[str, list[int]]:
    """`host` -> (host, []) meaning every slot; `host:0,2` -> (host, [0, 2])."""
    if ":" not in node_config:
        if node_config == "":
            raise ValueError("empty node in resource string; expected NAME[:SLOT[,SLOT...]]")
        return node_config, []
    hostname, _, slot_text = node_config.partition(":")
    if hostname == "" or ":" in slot_text:
        raise ValueError(f"bad node spec {node_config!r}; expected NAME[:SLOT[,SLOT...]]")
    try:
        slots = [int(x) for x in slot_text.split(",")]
    except ValueError:
        raise ValueError(f"bad slot list in {node_config!r}; slots are integers separated by ','") from None
    return hostname, slots


def parse_node_config_list(node_config_list: str) -> dict[str, list[int]]:
    """`a:0,1@b` -> {"a": [0, 1], "b": []}; repeated hosts merge their slots."""
    configs: dict[str, list[int]] = OrderedDict()
    for node_config in node_config_list.split("@"):
        hostname, slots = parse_node_config(node_config)
        configs.setdefault(hostname, [])
        configs[hostname] += slots
    return OrderedDict((host, sorted(set(slots))) for host, slots in configs.items())


def parse_resource_filter(host_info: Mapping[str, list[int]], include_str: str = "",
                          exclude_str: str = "") -> "OrderedDict[str, list[int]]":
    """Filter `{host: [slots]}` by an include or an exclude string (mutually exclusive).

    include "worker-0@worker-1:0,2" keeps all of worker-0 and slots 0 and 2 of worker-1;
    exclude "worker-1:0" keeps everything but slot 0 of worker-1. Host order is the pool's.
    """
    if include_str and exclude_str:
        raise ValueError("include_str and exclude_str are mutually exclusive.")
    if not include_str and not exclude_str:
        return OrderedDict((h, list(s)) for h, s in host_info.items())

    spec = include_str or exclude_str
    if include_str:
        filtered: dict[str, list[int]] = {}
    else:
        filtered = {h: list(s) for h, s in host_info.items()}

    for hostname, slots in parse_node_config_list(spec).items():
        if hostname not in host_info:
            raise ValueError(f"Hostname '{hostname}' not found in hostfile")
        for slot in slots:
            if slot not in host_info[hostname]:
                raise ValueError(f"No slot '{slot}' specified on host '{hostname}'")
        if include_str:
            filtered[hostname] = list(slots) if slots else list(host_info[hostname])
        elif slots:
            filtered[hostname] = [s for s in filtered[hostname] if s not in slots]
        else:
            filtered[hostname] = []

    ordered: "OrderedDict[str, list[int]]" = OrderedDict()
    for host in host_info:
        if host in filtered and filtered[host]:
            ordered[host] = list(dict.fromkeys(filtered[host]))
    return ordered


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str,
                              exclusion: str) -> "OrderedDict[str, list[int]]":
    """Map a slot-count pool `{host: N}` to `{host: [0..N-1]}` and apply include/exclude."""
    active = OrderedDict((host, list(range(count))) for host, count in resource_pool.items())
    return parse_resource_filter(active, include_str=inclusion, exclude_str=exclusion)


def apply_num_nodes_and_gpus(active_resources: Mapping[str, list[int]], num_nodes: int,
                             num_gpus: int) -> "OrderedDict[str, list[int]]":
    """--num_nodes keeps the first N hosts; --num_gpus gives every host slots [0, N)."""
    hosts = list(active_resources.items())
    if num_nodes > 0:
        hosts = hosts[:num_nodes]
    if num_gpus > 0:
        hosts = [(host, list(range(num_gpus))) for host, _ in hosts]
    return OrderedDict((host, list(slots)) for host, slots in hosts)


def encode_world_info(world_info: Mapping[str, list[int]]) -> str:
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")


def decode_world_info(world_info_base64: str) -> "OrderedDict[str, list[int]]":
    try:
        decoded = json.loads(base64.urlsafe_b64decode(world_info_base64), object_pairs_hook=OrderedDict)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--world_info is not base64-encoded JSON: {err}") from None
    if not isinstance(decoded, dict) or not decoded or not all(
            isinstance(v, list) and all(isinstance(s, int) for s in v) for v in decoded.values()):
        raise ValueError(f"--world_info must encode a non-empty {{host: [slot, ...]}} mapping, got {decoded!r}")
    return decoded


def count_local_gpus() -> int:
    """NVIDIA GPUs on this host, without creating a CUDA context.

    DS_ACCELERATOR=cpu, or CUDA_VISIBLE_DEVICES set to "" or "-1" (CUDA's way of hiding every
    device), means none: the job then runs as CPU processes.
    """
    if os.environ.get("DS_ACCELERATOR", "").lower() == "cpu":
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
        return 0
    proc_dir = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc_dir):
        entries = [e for e in os.listdir(proc_dir) if not e.startswith(".")]
        if entries:
            return len(entries)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def count_numa_nodes() -> int:
    """NUMA nodes that have CPUs (at least 1): the CPU slot count when a host has no GPU."""
    base = "/sys/devices/system/node"
    count = 0
    try:
        for name in os.listdir(base):
            if re.fullmatch(r"node\d+", name):
                with open(os.path.join(base, name, "cpulist")) as fd:
                    if fd.read().strip():
                        count += 1
    except OSError:
        return 1
    return max(count, 1)


def visible_device_ids(value: str) -> list[int]:
    """CUDA_VISIBLE_DEVICES as integer ids; UUID forms cannot become --include and raise."""
    ids = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ValueError(f"CUDA_VISIBLE_DEVICES={value!r} holds {item!r}, not an integer device index; "
                             "unset it and choose devices with --include localhost:0,1 instead")
        ids.append(int(item))
    return ids
