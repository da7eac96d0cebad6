"""What environment the ranks get: `.deepspeed_env` files and the variables forwarded to nodes.

`.deepspeed_env` (renamed by DS_ENV_FILE) holds `NAME=VALUE` lines; the launcher reads it from
the home directory and then the current directory (the latter wins). Blank lines and `#`
comments are skipped. Its variables go to every rank on every node, the local one included.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Iterable, Mapping

from deepspeed_c.launcher.constants import EXCLUDE_ENVS, EXPORT_ENVS

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def deepspeed_environment_name() -> str:
    return os.getenv("DS_ENV_FILE", ".deepspeed_env")


def parse_deepspeed_env(lines: Iterable[str], source: str = ".deepspeed_env") -> "OrderedDict[str, str]":
    """NAME=VALUE lines -> {NAME: VALUE}; the value is everything after the first '='."""
    result: "OrderedDict[str, str]" = OrderedDict()
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if line == "" or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _NAME.fullmatch(key):
            raise ValueError(f"{source}:{number}: expected NAME=VALUE, found {raw.rstrip()!r}")
        result[key] = value.strip()
    return result


def load_deepspeed_env(paths: Iterable[str], name: str | None = None) -> "OrderedDict[str, str]":
    """Merge the env files found in `paths` (in order; later ones override)."""
    name = deepspeed_environment_name() if name is None else name
    merged: "OrderedDict[str, str]" = OrderedDict()
    seen: set[str] = set()
    for directory in paths:
        path = os.path.abspath(os.path.join(directory, name))
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        with open(path, "r") as fd:
            merged.update(parse_deepspeed_env(fd.readlines(), source=path))
    return merged


def forwarded_variables(env: Mapping[str, str], prefixes: Iterable[str] = EXPORT_ENVS) -> "OrderedDict[str, str]":
    """Variables of this shell that multi-node launches pass on (NCCL*, PYTHON*, MV2*, UCX*, MLFLOW*)."""
    prefixes = tuple(prefixes)
    excluded: set[str] = set()
    for trigger, names in EXCLUDE_ENVS.items():
        if trigger in env:
            excluded.update(names)
    return OrderedDict((k, v) for k, v in env.items() if k.startswith(prefixes) and k not in excluded)
